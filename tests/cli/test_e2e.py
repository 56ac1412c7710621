"""Tier 3: the command line end to end, on real local processes (marked e2e), and its errors on bad input (run in
this process: ``cli_in_process``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_in_process import fxshard as fxshard_in_process

from fxshard.capture.modelfile import load_model_file
from fxshard.testing import cli, matrix
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parents[2]


def fxshard(*args, check=True, here=False):
    """``fxshard ARGS`` in a subprocess, or in this process (``here``) for a command that starts no worker."""
    if here:
        proc = fxshard_in_process(*args, cwd=ROOT)
    else:
        proc = cli(*args, timeout=600, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"fxshard {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.e2e
@pytest.mark.parametrize("sample", matrix(["gpt.py", "llama.py"], ["gpt.py"]))
def test_compile_and_run_matches_single_device_training(tmp_path, sample):
    out = tmp_path / "out"
    fxshard("compile", ROOT / "samples" / sample, "--tp", 2, "--out", out)
    run = fxshard("run", out, "--steps", 3, "--metrics", tmp_path / "m.jsonl")
    assert "step 3/3" in run.stdout
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    want = reference_losses(load_model_file(ROOT / "samples" / sample), 3)
    for got, ref in zip([x["loss"] for x in lines], want, strict=True):
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    show = fxshard("show", out, "--rank", 1)
    assert "class RankModule" in show.stdout and "rt.all_reduce(" in show.stdout
    summary = fxshard("show", out)
    assert "rank_pp0_tp1.py" in summary.stdout


@pytest.mark.e2e
def test_pipeline_compile_and_run_matches_single_device_training(tmp_path, samples):
    out = tmp_path / "out"
    comp = fxshard("compile", samples / "gpt2.py", "--pp", 2, "--schedule", "gpipe", "--microbatches", 4,
                   "--split-before", "transformer.h.1", "--out", out)
    assert "cut: split_before" in comp.stdout and "transformer.h.1-3 (+ after blocks)" in comp.stdout
    assert "tied: lm_head.weight is held by stages [0, 1]" in comp.stdout
    fxshard("run", out, "--steps", 3, "--metrics", tmp_path / "m.jsonl")
    got = [json.loads(x)["loss"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    want = reference_losses(load_model_file(samples / "gpt2.py"), 3)
    for g, r in zip(got, want, strict=True):
        assert abs(g - r) <= 1e-5 * abs(r), (g, r)
    show = fxshard("show", out, "--rank", 1)
    assert "class Stage1(torch.nn.Module):" in show.stdout and "receives from stage 0" in show.stdout


def test_pipeline_layout_errors_before_launch(tmp_path, samples):
    proc = fxshard("compile", samples / "gpt.py", "--pp", 4, "--microbatches", 2, "--out", tmp_path / "o",
                   check=False, here=True)
    assert proc.returncode == 2 and "needs at least 4 microbatches" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_model_file_without_make_model(tmp_path, models):
    proc = fxshard("compile", models / "no_make_model.py", "--tp", 2, "--out", tmp_path / "o", check=False, here=True)
    assert proc.returncode == 2
    assert "no_make_model.py" in proc.stderr and "defines no make_model()" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_model_export_cannot_capture_names_the_source_line(tmp_path, models):
    # without real weights (--meta): no run of the model can specialize the branch on the example batch
    proc = fxshard("compile", models / "control_flow.py", "--tp", 2, "--meta", "--out", tmp_path / "o", check=False,
                   here=True)
    assert proc.returncode == 2
    assert "data-dependent control flow" in proc.stderr
    assert "control_flow.py:" in proc.stderr and "if y.sum() > 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_output_folder_that_is_not_fxshards(tmp_path, samples):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8")
    run = fxshard("run", folder, "--steps", 1, check=False, here=True)
    assert run.returncode == 2 and "not an fxshard output folder" in run.stderr
    show = fxshard("show", folder, check=False, here=True)
    assert show.returncode == 2 and "not an fxshard output folder" in show.stderr
    comp = fxshard("compile", samples / "gpt.py", "--tp", 2, "--out", folder, check=False, here=True)
    assert comp.returncode == 2 and "is not an fxshard output folder" in comp.stderr
    assert (folder / "cat.jpg").exists()


def test_data_parallel_layout_errors_before_launch(tmp_path, samples):
    proc = fxshard("compile", samples / "gpt.py", "--tp", 2, "--dp", 3, "--out", tmp_path / "o", check=False, here=True)
    assert proc.returncode == 2 and "--dp 3: the batch of 8" in proc.stderr
    assert "use --dp in [1, 2, 4, 8]" in proc.stderr
    proc = fxshard("compile", samples / "gpt.py", "--zero", 4, "--out", tmp_path / "o", check=False, here=True)
    assert proc.returncode == 2 and "--zero must be 0, 1, 2 or 3" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_data_parallel_zero3_with_clipping_from_the_command_line(tmp_path, samples):
    out = tmp_path / "out"
    comp = fxshard("compile", samples / "gpt.py", "--dp", 2, "--zero", 3, "--out", out)
    assert "zero=3" in comp.stdout
    code = (out / "rank_pp0_tp0.py").read_text()
    assert "def attach_data_parallel(module, dp_mesh):" in code
    assert ("return rt.fully_shard(module, dp_mesh, reshard_after_forward=True, blocks=[getattr(module, b) for b in "
            "module.BLOCKS])") in code
    assert "BLOCKS = ('blocks_0', 'blocks_1'," in code  # each block its own FSDP2 unit
    fxshard("run", out, "--steps", 3, "--clip-grad-norm", 0.05, "--grad-accum", 2, "--metrics", tmp_path / "m.jsonl")
    got = [json.loads(x)["loss"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    from fxshard.train.optim import OptimConfig

    want = reference_losses(load_model_file(samples / "gpt.py"), 3, OptimConfig(clip_grad_norm=0.05, grad_accum=2))
    for g, r in zip(got, want, strict=True):
        assert abs(g - r) <= 1e-5 * abs(r), (g, r)


def test_plan_file_with_unmatched_key_warns(tmp_path, models):
    plan = tmp_path / "plan.py"
    plan.write_text("import fxshard\nPLAN = {'mlp.fc_in': fxshard.colwise(), 'mlp.fc_out': fxshard.rowwise(),\n"
                    "        'mlp.nope': fxshard.colwise()}\n")
    proc = fxshard("compile", models / "mlp.py", "--tp", 2, "--plan", plan, "--out", tmp_path / "o", here=True)
    assert "warning: user plan key 'mlp.nope' matches no module" in proc.stderr
    # one line, like an error: no source line of the caller (once `result = compile_program(...)`) after it
    assert "compile_program(" not in proc.stderr and "UserWarning" not in proc.stderr, proc.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("layout, names, plain", [
    ((3, 0), {"all_reduce (DDP bucket 0)"}, ()),
    pytest.param((2, 3), {"all_gather (FSDP2 issue)", "all_gather (FSDP2 wait, copy out)", "reduce_scatter (FSDP2)"},
                 (), marks=pytest.mark.matrix),
    pytest.param((2, 1), {"all_gather (ZeRO-1 bucket 0, issued by the step)"}, ("--no-overlap-param-gather",),
                 marks=pytest.mark.matrix),
], ids=["dp3-zero0", "dp2-zero3", "dp2-zero1"])
def test_traced_dp_collectives_are_events_and_change_nothing(tmp_path, samples, layout, names, plain):
    """--trace times torch's own dp collectives (a DDP comm hook; FSDP2's gathers and reduce-scatters) and ZeRO 1's
    parameter all-gathers left in flight (issue to completion) on a second row per rank, and the traced run trains
    bitwise as the untraced one (dp=3, where dividing the bucket instead of multiplying by 1/3 as DDP's reducer does
    would differ in the last bit; ZeRO 1 untraced with its gathers waited for in the step, traced overlapped)."""
    src = (samples / "gpt.py").read_text()
    model = tmp_path / "gpt6.py"
    model.write_text(src.replace("BATCH = 256, 16, 64, 4, 8, 8", "BATCH = 256, 16, 64, 4, 8, 6"))
    assert model.read_text() != src
    from safetensors.torch import load_file

    dp, zero = layout
    out = tmp_path / f"dp{dp}z{zero}"
    fxshard("compile", model, "--dp", dp, "--zero", zero, "--out", out)
    fxshard("run", out, "--steps", 2, "--final-state", out / "plain", *plain)
    (out / "trace").mkdir()
    fxshard("run", out, "--steps", 2, "--final-state", out / "traced", "--trace", out / "trace")
    events = [e for e in json.loads((out / "trace" / "trace.json").read_text())["traceEvents"] if e.get("cat") == "dp"]
    assert {e["name"] for e in events} == names, layout
    assert {e["pid"] for e in events} == set(range(dp)) and all(e["tid"] == 1 for e in events)
    assert all(e["args"]["bytes"] > 0 and e["args"]["ranks"] == list(range(dp)) for e in events)
    for r in range(dp):
        untraced, traced = (load_file(out / f / f"rank{r}.safetensors") for f in ("plain", "traced"))
        assert all(untraced[k].equal(traced[k]) for k in untraced), (layout, r)


@pytest.mark.e2e
@pytest.mark.parametrize("sample, flags", [
    ("gpt.py", ["--tp", 2]),
    pytest.param("llama.py", ["--tp", 2, "--dtype", "bf16", "--recompute", "selective"], marks=pytest.mark.matrix)])
def test_overlapped_backward_trains_bitwise_as_the_plain_program(tmp_path, samples, sample, flags):
    """rt.copy_to_linears (the default) against --no-overlap (rt.copy_to and the linears): the same trained tensors
    to the bit, since its backward computes the gradients autograd computes, in autograd's order."""
    from safetensors.torch import load_file

    for mode in ("--overlap", "--no-overlap"):
        out = tmp_path / mode.strip("-")
        fxshard("compile", samples / sample, *flags, mode, "--out", out)
        code = (out / "rank_pp0_tp0.py").read_text()
        fused = mode == "--overlap"
        assert ("rt.copy_to_linears(" in code) == fused and ("rt.copy_to(" in code) != fused
        fxshard("run", out, "--steps", 3, "--final-state", out / "state")
    for r in range(2):
        a, b = (load_file(tmp_path / m / "state" / f"rank{r}.safetensors") for m in ("overlap", "no-overlap"))
        assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a), r
