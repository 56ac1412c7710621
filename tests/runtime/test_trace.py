"""The trace writer (``fxshard run --trace``): Chrome trace events per rank, joined into one file, and nothing
recorded while it is off."""

from __future__ import annotations

import json
import time

from fxshard.runtime import trace


def test_off_records_nothing_and_costs_one_shared_context():
    assert not trace.enabled()
    assert trace.span("F0", "pipeline") is trace.span("all_reduce", "collective", bytes=4)
    with trace.span("F0", "pipeline"):
        pass
    assert trace.save() is None


def test_spans_are_complete_events_of_the_rank_and_nest(tmp_path):
    trace.start(3, tmp_path)
    with trace.span("step 1", "step", step=1):
        with trace.span("F0", "pipeline", stage=1, microbatch=0, action="F"):
            time.sleep(0.002)
        with trace.span("all_reduce", "collective", bytes=4096):
            pass
    path = trace.save()
    assert path == tmp_path / "rank3.json" and not trace.enabled()
    events = json.loads(path.read_text())["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    assert {e["name"] for e in meta} == {"process_name", "process_sort_index"}
    assert meta[0]["args"] == {"name": "rank 3"}
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {"step 1", "F0", "all_reduce"}
    assert all(e["pid"] == 3 and e["tid"] == 0 for e in spans.values())
    step, f0, ar = spans["step 1"], spans["F0"], spans["all_reduce"]
    assert f0["dur"] >= 2000  # microseconds
    assert step["ts"] <= f0["ts"] and f0["ts"] + f0["dur"] <= ar["ts"] <= step["ts"] + step["dur"]
    assert f0["args"] == {"stage": 1, "microbatch": 0, "action": "F"} and ar["args"] == {"bytes": 4096}
    assert abs(step["ts"] / 1e6 - time.time()) < 60  # wall-clock microseconds: ranks share a time axis


def test_merge_joins_every_rank_into_one_process_each(tmp_path):
    for rank in range(2):
        trace.start(rank, tmp_path)
        with trace.span("F0", "pipeline", stage=rank, microbatch=0, action="F"):
            pass
        trace.save()
    merged = json.loads(trace.merge(tmp_path, 2).read_text())
    assert merged["displayTimeUnit"] == "ms"
    assert sorted({e["pid"] for e in merged["traceEvents"]}) == [0, 1]
    assert [e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"] == [0, 1]
