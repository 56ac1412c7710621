"""Tier 1: the manifest's collective list is read off the final graph, the graph fxshard plan costs; fxshard check
matches what the rank files issue against it, the fused copy_to_linears and each block call included."""

from __future__ import annotations

import re

from fxshard.check.check import check_output
from fxshard.codegen.collective_list import collective_entries
from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.ir.comm import KINDS
from fxshard.ir.context import Layout, spec
from fxshard.runtime import collectives as rtc


def test_the_manifest_lists_what_the_planned_graph_issues_and_check_finds_it_in_the_files(samples, tmp_path):
    layout = Layout(tp=2)
    result = compile_model(samples / "gpt.py", layout, out=tmp_path / "out")
    planned = compile_program(samples / "gpt.py", layout, meta=True)  # as fxshard plan compiles: in memory, on meta
    for entry in result.manifest.ranks:
        assert entry.collectives == collective_entries(planned.gm, planned.ctx, entry.coords.pp)
    report = check_output(tmp_path / "out")  # traces the files' collectives and matches them with the list
    assert report.traced and report.groups

    entries = result.manifest.ranks[0].collectives
    fused = [n for n in planned.gm.graph.nodes if n.target is rtc.copy_to_linears]
    assert sum(c.op == "copy_to_linears" for c in entries) == len(fused) == 17  # 2 per block, and the LM head
    # a block's collectives at each of its calls, by the names of the block's class; the rest by the graph's
    in_blocks = [c for n, c in zip(_communicating(planned.gm), entries, strict=True) if spec(n).block]
    assert [c.value for c in in_blocks[:4]] == ["copy_to_linears", "all_reduce", "copy_to_linears_1", "all_reduce_1"]
    assert [c.value for c in in_blocks[4:8]] == [c.value for c in in_blocks[:4]]
    code = result.sources["rank_pp0_tp0.py"]
    assert all(re.search(rf"\b{c.value} = rt\.{c.op}\(", code) for c in entries)


def test_without_overlap_the_list_has_the_copy_to_the_graph_keeps(samples):
    planned = compile_program(samples / "gpt.py", Layout(tp=2, overlap=False), meta=True)
    ops = [c.op for c in collective_entries(planned.gm, planned.ctx, 0)]
    assert "copy_to_linears" not in ops and ops.count("copy_to") == 17


def _communicating(gm):
    return [n for n in gm.graph.nodes if spec(n).collective and KINDS[n.target.__name__].communicates]


def test_fp8_linears_under_sp_fuse_and_both_traces_list_amaxes_then_the_gather(samples, tmp_path):
    """Under --sp and --fp8 the column-parallel fp8 linears reading a gather_to are one rt.fp8_linears_regathered:
    backward it all-reduces their gradients' amaxes, then all-gathers the shard again.  The manifest says so, and
    fxshard check's two readings of the file (run on meta tensors, and scanned without running) list the same
    operations in the same order."""
    from fxshard.check.rank_trace import trace_rank

    layout = Layout(tp=2, sp=True, fp8="tensorwise")
    result = compile_model(samples / "llama.py", layout, out=tmp_path / "out")
    entry = result.manifest.ranks[0]
    fused = [c for c in entry.collectives if c.op == "fp8_linears_regathered"]
    assert len(fused) == 8 and all(c.backward == "all_reduce + all_gather" for c in fused)  # q/k/v, gate/up x 4
    source = result.sources[entry.file]
    ran, scanned = (trace_rank(source, entry.file, result.manifest, entry, run=run) for run in (True, False))
    for name, cls in ran.classes.items():
        for direction in ("forward", "backward"):
            want = [(c.kind, c.call, c.line) for c in getattr(cls, direction)]
            assert want == [(c.kind, c.call, c.line) for c in getattr(scanned.classes[name], direction)], name
    ops = [c.kind for c in ran.classes["RankModule"].backward if c.call == "fp8_linears_regathered"]
    assert ops == ["all_reduce", "all_gather"] * 8
    assert check_output(tmp_path / "out").traced
