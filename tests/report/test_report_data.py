"""``fxshard report``'s data and page, from a real compile of samples/llama.py at tp=2 pp=2 dp=2 (no run: the
compile is in-process, the trace written by the real trace writer for the ranks a run would have)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.layout import Coords, Layout
from fxshard.report.data import report_data
from fxshard.report.render import render
from fxshard.runtime import trace

LLAMA = Path(__file__).resolve().parents[2] / "samples" / "llama.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    compile_model(LLAMA, Layout(tp=2, pp=2, dp=2), out=folder)
    return folder


@pytest.fixture(scope="module")
def data(out):
    return report_data(out, device_memory=880 * 2**10, model=LLAMA)  # between the two pp ranks' predicted peaks


def test_one_cell_per_rank_with_its_file_and_the_plans_memory(data):
    assert [c.rank for c in data.cells] == list(range(8))
    cell = data.cells[5]  # dp=1 pp=0 tp=1
    assert cell.coords == Coords(dp=1, pp=0, tp=1) and cell.file == "rank_pp0_tp1.py"
    assert cell.holds.startswith("stage 0: model.layers.0-1")
    plan = {r["pp_rank"]: r for r in data.plan_rows}
    for c in data.cells:
        assert sum(c.memory.values()) == pytest.approx(c.peak) == pytest.approx(plan[c.coords.pp]["peak"])
        assert c.fits == (c.peak <= 880 * 2**10)
    assert {c.fits for c in data.cells} == {True, False}  # pp rank 0 holds two microbatches' activations


def test_modules_carry_placements_lines_and_collectives(out, data):
    mods = data.modules["rank_pp0_tp0.py"]
    roles = {m.fqn: m.role for m in mods}
    assert roles["model.layers.{0-1}.self_attn.q_proj"] == "column-parallel"
    assert roles["model.layers.{0-1}.mlp.down_proj"] == "row-parallel"
    assert roles["model.embed_tokens"] == "vocab-parallel"
    lines = (out / "rank_pp0_tp0.py").read_text().splitlines()
    down = next(m for m in mods if m.fqn.endswith("mlp.down_proj"))
    assert down.instances == 2 and "mlp.down_proj  Linear  row-parallel" in lines[down.first - 1]
    (call,) = down.collectives
    assert "rt.all_reduce(" in lines[call.line - 1]
    assert (call.forward, call.backward, call.forward_bytes) == ("all_reduce", None, 1 * 16 * 64 * 4)
    # every collective line of the file is attributed to a module, as many as the file has
    issued = re.compile(r"= rt\.(all_reduce|copy_to|copy_to_linears|all_gather|scatter)\(")
    assert sum(len(m.collectives) for m in mods) == sum(1 for t in lines if issued.search(t))


def test_schedule_rows_per_pp_rank_in_torchs_order(data):
    s = data.schedule
    assert (s.name, s.microbatches, sorted(s.rows)) == ("1f1b", 2, [0, 1])
    assert [f"{x.action}{x.microbatch}" for x in s.rows[1]] == ["F0", "B0", "F1", "B1"]
    assert s.bubble == pytest.approx(s.plan_bubble) == pytest.approx(1 / 3)


def test_measured_step_from_the_trace_files(out, tmp_path):
    folder = tmp_path / "trace"
    folder.mkdir()
    for rank in range(8):
        trace.start(rank, folder)
        for step in (1, 2):
            with trace.span(f"step {step}", "step", step=step), trace.span("F0", "pipeline", stage=0, microbatch=0,
                                                                          action="F"):
                pass
        trace.save()
    trace.merge(folder, 8)
    data = report_data(out, trace=folder)
    assert data.measured.step == 2 and sorted(data.measured.rows) == list(range(8))
    assert [e["name"] for e in data.measured.rows[0]] == ["F0"]  # step 2's only


def test_the_page_is_self_contained_and_shows_each_part(data):
    page = render(data)
    assert page.count('class="cell') == 8 and page.count('<g class="row"') == 2
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched
    for anchor in ("rank_pp0_tp0.py-L1", "file-rank_pp1_tp1.py"):
        assert f'id="{anchor}"' in page
    assert "does not fit" in page and "Not traced" in page and "No run of this compile yet" in page


def _traced(folder: Path, ranks: int = 8) -> None:
    folder.mkdir()
    for rank in range(ranks):
        trace.start(rank, folder)
        with trace.span("step 1", "step", step=1), trace.span("F0", "pipeline", stage=0, microbatch=0, action="F"):
            pass
        trace.save()
    trace.merge(folder, ranks)


def test_a_moved_folder_keeps_its_run_and_a_lost_trace_is_said(out, tmp_path):
    import json
    import shutil

    from fxshard.train.options import RunOptions
    from fxshard.train.record import write_run_record

    folder = tmp_path / "a"
    shutil.copytree(out, folder)
    _traced(folder / "trace")
    (folder / "m.jsonl").write_text(json.dumps({"step": 1, "loss": 5.5, "seconds": 0.2, "tokens": 64}) + "\n")
    write_run_record(folder, RunOptions(steps=1, metrics=folder / "m.jsonl", trace=folder / "trace"), [5.5], None)
    assert json.loads((folder / "run.json").read_text())["trace"] == "trace"  # inside the folder: relative
    moved = tmp_path / "b"
    folder.rename(moved)
    data = report_data(moved)
    assert data.measured is not None and data.run.metrics == str(moved / "m.jsonl") and not data.warnings
    shutil.rmtree(moved / "trace")
    (moved / "m.jsonl").unlink()
    data = report_data(moved)
    assert data.measured is None and data.run.metrics is None  # the losses still come from run.json
    assert [w.split(":")[0] for w in data.warnings] == [
        "the last run wrote its metrics to m.jsonl, which is not there now; pass --metrics FILE",
        "the last run's trace, trace"]
    assert "not there now" in render(data)


def test_a_trace_given_that_is_not_one_is_refused(out, tmp_path):
    from fxshard.errors import OptionError

    (tmp_path / "m.jsonl").write_text("{}\n")
    with pytest.raises(OptionError, match=r"--trace .*m\.jsonl: expected a folder `fxshard run --trace` wrote"):
        report_data(out, trace=tmp_path / "m.jsonl")


def test_report_to_a_path_it_cannot_write_is_one_clear_line(out, tmp_path):
    from fxshard.cli.app import app
    from typer.testing import CliRunner

    for to, found in ((tmp_path / "nope" / "x.html", "found no folder"), (tmp_path, "found a folder")):
        result = CliRunner().invoke(app, ["report", str(out), "--to", str(to)])
        assert result.exit_code != 0 and found in result.output and "Traceback" not in result.output, result.output


def test_fused_linears_under_sp_report_the_gathered_input_once(tmp_path):
    """Under --sp the linears reading a gather_to keep its shard and gather it again in backward: that all-gather's
    whole buffer is the gathered input, the bytes the gather_to before it moves forward (its line states them; the
    report once multiplied them by tp)."""
    compile_model(LLAMA, Layout(tp=2, sp=True), out=tmp_path)
    mods = report_data(tmp_path, model=LLAMA).modules["rank_pp0_tp0.py"]
    calls = [c for m in mods for c in m.collectives]
    fused = [i for i, c in enumerate(calls) if c.op == "linears_regathered"]
    assert fused
    for i in fused:
        gather = calls[i - 1]
        assert gather.op == "gather_to" and gather.shape == calls[i].shape, (gather, calls[i])
        assert calls[i].backward == "all_gather" and calls[i].backward_bytes == gather.forward_bytes > 0
