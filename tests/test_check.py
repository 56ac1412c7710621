"""Static checks (``fxshard.check.check``): generated files pass; edited, stale or mismatched files are caught
with the rank, the file line and the collective, before anything runs.  Single process, meta tensors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from fxshard.cli.app import app
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fxshard.check.check import check_output
from fxshard.driver import compile
from fxshard.errors import CheckError, OutputFolderError
from fxshard.ir.context import Layout


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile each (model, layout) once per module; tests edit copies."""
    root = Path(__file__).resolve().parents[1]
    cache = {}

    def get(name: str, model: str, **layout):
        if name not in cache:
            out = tmp_path_factory.mktemp(name) / "out"
            cache[name] = compile(root / model, Layout(**layout), out=out)
        return cache[name]

    return get


def gpt_tp2(compiled):
    return compiled("gpt_tp2", "samples/gpt.py", tp=2)


def gpt_pipeline(compiled):
    return compiled("gpt_tp2_pp2", "samples/gpt.py", tp=2, pp=2)


def copy(result, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(result.out, out)
    return out


def edit(path: Path, old: str, new: str) -> int:
    """Replace the one occurrence of ``old``; return its line number."""
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return text[:text.index(old)].count("\n") + 1


def check_error(out: Path) -> str:
    """What check says of an edited folder when told to run it anyway (without --allow-edited it refuses the edited
    file before running anything, tests/cli/test_trust_look.py)."""
    with pytest.raises(CheckError) as info:
        check_output(out, allow_edited=True)
    return str(info.value)


@pytest.mark.slow
def test_generated_files_pass_and_compile_time_scan_agrees_with_the_meta_run(compiled):
    for result in (gpt_tp2(compiled), gpt_pipeline(compiled)):
        report = check_output(result.out)
        assert report.traced and not result.checks.traced
        traced = [(g.label, g.scope, g.forward, g.backward) for g in report.groups]
        assert traced == [(g.label, g.scope, g.forward, g.backward) for g in result.checks.groups]
    assert traced[:2] == [("tp group [0, 1]", "Stage0", 9, 8), ("tp group [2, 3]", "Stage1", 9, 9)]
    assert ("tied-weight group [0, 2]", "sync_tied_grads", 0, 1) in traced
    assert report.links == ["stage 0 -> stage 1: 1 tensor per microbatch"]  # the targets are taken from the batch
    plain = check_output(gpt_tp2(compiled).out)
    # 16 row-parallel all-reduces + the vocab-parallel embedding's + the vocab-parallel cross entropy's
    # all-gather + the returned logits' all-gather; backward: one all-reduce per column-parallel input (copy_to)
    assert [(g.label, g.forward, g.backward) for g in plain.groups] == [("tp group [0, 1]", 19, 17)]


def test_dropped_all_reduce_names_rank_line_and_collective(compiled, tmp_path):
    out = copy(gpt_tp2(compiled), tmp_path)
    line = edit(out / "rank_pp0_tp1.py", "all_reduce = rt.all_reduce(embedding, self.tp)", "all_reduce = embedding")
    msg = check_error(out)
    assert msg.startswith(f"rank_pp0_tp1.py:{line} (global rank 1): tp group [0, 1] in RankModule: "
                          "forward collective #1 is missing: ")
    assert f"rank_pp0_tp0.py:{line} (global rank 0) issues all_reduce float32 [8, 16, 64] " \
           "(all_reduce = rt.all_reduce(...))" in msg
    assert "issues 18 forward collectives there, the other 19; running this would hang" in msg
    assert msg.endswith("Recompile with `fxshard compile` instead of editing generated files.")


def test_reordered_collectives_name_both_lines(compiled, tmp_path):
    out = copy(compiled("branches", "tests/models/branches.py", tp=2), tmp_path)
    path = out / "rank_pp0_tp1.py"
    lines = path.read_text().splitlines(keepends=True)
    first = next(i for i, x in enumerate(lines) if x.strip().startswith("linear_2 = "))
    second = next(i for i, x in enumerate(lines) if x.strip().startswith("all_reduce_1 = rt.all_reduce("))
    moved = lines[second - 1:second + 1]  # b_out's matmul and its all-reduce, moved before a_out's
    path.write_text("".join(lines[:first] + moved + lines[first:second - 1] + lines[second + 1:]))
    ref_line = next(i + 1 for i, x in enumerate(lines) if x.strip().startswith("all_reduce = rt.all_reduce("))
    msg = check_error(out)
    assert msg.startswith(f"rank_pp0_tp1.py:{first + 2} (global rank 1): tp group [0, 1] in RankModule: "
                          "forward collective #1 is all_reduce float32 [4, 24] (all_reduce_1 = rt.all_reduce(...)) "
                          f"but rank_pp0_tp0.py:{ref_line} (global rank 0) issues all_reduce float32 [4, 8] "
                          "(all_reduce = rt.all_reduce(...)); the order differs: rank_pp0_tp0.py issues all_reduce_1 "
                          "as #2; running this would hang"), msg


def test_dropped_copy_to_is_caught_in_backward(compiled, tmp_path):
    out = copy(gpt_tp2(compiled), tmp_path)
    # the LM head's column-parallel input, whose copy_to is written fused with the linear (rt.copy_to_linears)
    line = edit(out / "rank_pp0_tp1.py", "copy_to_linears_16 = rt.copy_to_linears(layer_norm_16, self.tp, "
                "weights=(self.lm_head_weight,), biases=(None,))",
                "copy_to_linears_16 = (aten.linear.default(layer_norm_16, self.lm_head_weight),)")
    msg = check_error(out)
    assert re.match(rf"rank_pp0_tp1\.py:{line} \(global rank 1\): tp group \[0, 1\] in RankModule: backward "
                    rf"collective #\d+ is missing: rank_pp0_tp0\.py:{line} \(global rank 0\) issues all_reduce "
                    r"float32 \[8, 16, 64\] \(copy_to_linears_16 = rt\.copy_to_linears\(\.\.\.\)\)", msg), msg


def test_collective_over_the_wrong_group(compiled, tmp_path):
    out = copy(gpt_pipeline(compiled), tmp_path)
    line = edit(out / "rank_pp1_tp1.py", "rt.all_gather(vocab_cross_entropy_parts, self.tp,",
                "rt.all_gather(vocab_cross_entropy_parts, self.pp,")
    msg = check_error(out)
    assert "2 problems:" in msg
    assert f"rank_pp1_tp1.py:{line} (global rank 3): tp group [2, 3] in Stage1: forward collective #" in msg
    assert f"rank_pp1_tp1.py:{line} (global rank 3): pp group [1, 3] in all stages: forward collective #1 " \
           "all_gather float32 [64, 1, 2]" in msg and "is not issued by rank_pp0_tp1.py (global rank 1)" in msg


def test_rank_file_that_fails_to_run_names_its_line(compiled, tmp_path):
    out = copy(gpt_tp2(compiled), tmp_path)
    line = edit(out / "rank_pp0_tp0.py", "aten.view.default(linear, [8, 16, 2, 16])",
                "aten.view.default(linear, [8, 16, 4, 16])")
    assert check_error(out).startswith(f"rank_pp0_tp0.py:{line}: RankModule fails when run on meta tensors of the "
                                       "declared shapes: RuntimeError: shape '[8, 16, 4, 16]' is invalid")


def test_pipeline_send_without_its_receive(compiled, tmp_path):
    out = copy(gpt_pipeline(compiled), tmp_path)
    line = edit(out / "rank_pp1_tp0.py", "INPUTS = (('blocks_3_out', (4, 16, 64), torch.float32, True)",
                "INPUTS = (('blocks_3_out', (4, 16, 64), torch.float32, False)")
    msg = check_error(out)
    sent = next(i + 1 for i, x in enumerate((out / "rank_pp0_tp0.py").read_text().splitlines())
                if x.strip().startswith("OUTPUTS ="))
    assert msg.startswith(f"rank_pp0_tp0.py:{sent}: Stage0 sends tensor #1 as float32 [4, 16, 64] (with gradient) "
                          f"but rank_pp1_tp0.py:{line}: Stage1 receives float32 [4, 16, 64]; a send without its "
                          "matching receive hangs"), msg


def test_stage_taking_a_user_input_the_batch_does_not_have(compiled, tmp_path):
    out = copy(gpt_pipeline(compiled), tmp_path)
    edit(out / "rank_pp1_tp0.py", "BATCH = ('targets',)", "BATCH = ('tgts',)")
    assert "rank_pp1_tp0.py: Stage1.BATCH names the user input 'tgts', which manifest.json does not list" \
        in check_error(out)


def test_stale_rank_file_from_another_compile(compiled, tmp_path):
    out = copy(gpt_tp2(compiled), tmp_path)
    shutil.copyfile(gpt_pipeline(compiled).out / "rank_pp0_tp1.py", out / "rank_pp0_tp1.py")
    msg = check_error(out)
    assert msg.startswith("2 problems:")
    assert "rank_pp0_tp1.py:4: compiled for tp=2 pp=2 dp=1, but manifest.json is for tp=2 pp=1 dp=1: " \
           "a rank file left from another compile" in msg
    assert "rank_pp0_tp1.py: defines no class RankModule, which the manifest lists for it" in msg


def test_manifest_layout_that_does_not_match_its_files(compiled, tmp_path):
    out = copy(gpt_tp2(compiled), tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["layout"]["dp"] = 2
    (out / "manifest.json").write_text(json.dumps(manifest))
    msg = check_error(out)
    assert "manifest.json: mesh shape [1, 1, 2] but the layout tp=2 pp=1 dp=2 zero=0 needs [2, 1, 2]" in msg
    assert "rank_pp0_tp0.py runs on global rank 0, but pp=0 tp=0 of a world of 4 is global ranks 0, 2" in msg
    (out / "rank_pp0_tp1.py").unlink()
    with pytest.raises(OutputFolderError, match="rank_pp0_tp1.py listed in the manifest is missing"):
        check_output(out)


def test_weight_shard_that_does_not_match_the_code(compiled, tmp_path):
    out = copy(gpt_tp2(compiled), tmp_path)
    path = out / "weights" / "rank_pp0_tp1.safetensors"
    tensors = load_file(str(path))
    tensors["blocks_0.mlp_fc_in_weight"] = tensors["blocks_0.mlp_fc_in_weight"][:64].clone()
    save_file(tensors, str(path))
    assert check_error(out).startswith("rank_pp0_tp1.py: creates blocks_0.mlp_fc_in_weight with shape [128, 64], but "
                                       "weights/rank_pp0_tp1.safetensors has [64, 64]")


def test_cli_check_prints_the_groups_and_exits_2_on_a_mismatch(compiled, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["check", str(gpt_pipeline(compiled).out)])
    assert ok.exit_code == 0, ok.output
    assert "tp group [2, 3]" in ok.output and "pipeline stage 0 -> stage 1" in ok.output
    assert "OK: 4 rank file(s) agree on the collectives of every tp, pp, tied-weight group" in ok.output
    out = copy(gpt_tp2(compiled), tmp_path)
    edit(out / "rank_pp0_tp1.py", "all_reduce = rt.all_reduce(embedding, self.tp)", "all_reduce = embedding")
    bad = runner.invoke(app, ["check", str(out), "--allow-edited"])
    assert bad.exit_code == 2
    assert "error: rank_pp0_tp1.py:" in bad.stderr and "running this would hang" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_truncated_weights_file_is_named_not_a_traceback(compiled, tmp_path):
    out = copy(gpt_tp2(compiled), tmp_path)
    shard = out / "weights" / "rank_pp0_tp1.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    message = check_error(out)
    assert message.startswith(f"{shard}: cannot read the weights of rank_pp0_tp1.py (SafetensorError")
    assert "the file is unreadable, truncated or damaged" in message
    result = CliRunner().invoke(app, ["check", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.stderr


def test_each_ep_rank_is_checked_against_its_group(compiled, tmp_path):
    # under --ep the ranks of an ep group run one rank file (per pp x tp coordinate), so their exchanges are the
    # same lines; what can differ per ep rank is its manifest entry and its weight shard, and both are checked
    result = compiled("qwen3moe_dp4_ep2", "tests/models/hf_qwen3_moe.py", dp=4, ep=2)
    report = check_output(result.out)
    assert [(g.label, g.forward, g.backward) for g in report.groups] == [("ep groups [0, 1], [2, 3]", 6, 4)]
    # ep rank 1 pointed at another rank file, one whose second all-to-all is gone: a rank that would hang
    out = copy(result, tmp_path)
    rank_file = (out / "rank_pp0_tp0.py").read_text()
    combine = next(line.split(" = ")[1].split(";")[0] for line in rank_file.splitlines()
                   if "rt.all_to_all_combine(" in line)
    value = combine.split("(")[1].split(",")[0]
    (out / "rank_pp0_tp0_ep1.py").write_text(rank_file.replace(combine, value))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["ranks"][1]["file"] = "rank_pp0_tp0_ep1.py"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert "the rank file of pp=0 tp=0 is rank_pp0_tp0_ep1.py, expected rank_pp0_tp0.py" in check_error(out)
    # ep rank 1's shard holding all 4 experts of a layer instead of its 2: its exchange would expect other counts
    out = tmp_path / "shard"
    shutil.copytree(result.out, out)
    shard = out / "weights" / "rank_pp0_tp0_ep1.safetensors"
    tensors = load_file(shard)
    tensors["model_layers_0.mlp_experts_down_proj"] = tensors["model_layers_0.mlp_experts_down_proj"].repeat(2, 1, 1)
    save_file(tensors, shard)
    assert ("creates model_layers_0.mlp_experts_down_proj with shape [2, 32, 16], but "
            "weights/rank_pp0_tp0_ep1.safetensors has [4, 32, 16]") in check_error(out)
