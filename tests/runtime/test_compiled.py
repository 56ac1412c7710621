"""``fxshard run --compile``: the generated code through torch.compile (inductor) trains exactly as eager.

Real gloo processes, ``tests/models/tiny_gpt.py`` (2 blocks of width 32: inductor compiles for tens of seconds on
two shared cores, less once its cache holds the graphs) and, under ``--ep``, ``tests/models/hf_mixtral.py`` (2
layers of 4 experts, top 2; at tp=2 its experts split inside by moe_tp_experts). Each case trains 4 steps eagerly
and 4 compiled from the same weights and batches in the same processes, the compiled one's static fp32
``mm``/``addmm`` on oneDNN (``--cpu-matmul``'s default kernel, unlike the eager run's MKL; its size threshold
lowered to 0 for these small models; under ``--ep`` the experts' products, of as many rows as the routing sends,
stay on MKL); the losses must agree within 1e-6 relative (fp32), both must match single-device training within
verify's 1e-5, and no step after the first may compile a graph (under ``--ep`` the rows each rank's experts get
differ from step to step).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fxshard.capture.modelfile import load_model_file
from fxshard.driver import compile as compile_model
from fxshard.errors import OptionError
from fxshard.ir.context import Layout
from fxshard.testing import case_result, cli, matrix, selected_cases, spawn_cases
from fxshard.train.options import check_compile
from fxshard.train.reference import reference_losses

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny_gpt.py"
MIXTRAL = Path(__file__).resolve().parents[1] / "models" / "hf_mixtral.py"
STEPS = 4
COMPILED_RTOL = 1e-6  # compiled vs eager, fp32 (issue 19)
REFERENCE_RTOL = 1e-5  # either vs one device (fxshard verify's default)
LAYOUTS = {
    "tp2": Layout(tp=2),
    "dp2-zero1": Layout(dp=2, zero=1),  # DDP around the compiled module, optimizer state sharded
    "dp2-zero3": Layout(dp=2, zero=3),  # FSDP2: one unit per (compiled) block, hooks outside the graphs
    "pp2": Layout(pp=2, microbatches=2),  # each stage's module compiled
    # torch's checkpoint under compile: the partitioner recomputes in the compiled backward (collectives included)
    "tp2-recompute-selective": Layout(tp=2, recompute="selective"),
    "tp2-recompute-full": Layout(tp=2, recompute="full"),
    # the exchanges run eagerly between compiled regions (their sizes are the routing's)
    "mixtral-dp2-ep2": (MIXTRAL, Layout(dp=2, ep=2)),
    # regional: torch's checkpoint runs eagerly around each compiled block, which runs again in backward
    "mixtral-dp2-ep2-recompute-full": (MIXTRAL, Layout(dp=2, ep=2, recompute="full")),
    # moe_tp_experts (the model's own plan): the split grouped matmuls and their all-reduce in the one graph
    "tp2-mixtral-split-experts": (MIXTRAL, Layout(tp=2)),
}


def _eager_and_compiled(out: str) -> dict:
    import torch._dynamo

    import fxshard.runtime.experts as experts
    import fxshard.runtime.matmul as matmul
    import fxshard.train.launch as launch
    from fxshard.runtime.compiled import compile_seconds
    from fxshard.runtime.matmul import onednn_products
    from fxshard.train.options import RunOptions

    quiet = dict(log=lambda *_: None)
    eager = launch.train(Path(out), RunOptions(STEPS), **quiet)
    matmul.MIN_MULTIPLY_ADDS = 0  # the models' products are too small for oneDNN's default: every one on it here
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    # graphs compiled after each step; rows each dispatch got; bytes saved for backward
    graphs, rows, saved = [], [], []
    step, dispatch = launch._Loop._step, experts._dispatch

    def counted_step(self, *args):
        loss = step(self, *args)
        graphs.append(counters["stats"]["unique_graphs"])
        return loss

    def counted_dispatch(x, *args):
        out = dispatch(x, *args)
        rows.append(out.shape[0])
        return out

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    launch._Loop._step, experts._dispatch = counted_step, counted_dispatch
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            compiled = launch.train(Path(out), RunOptions(STEPS, compile=True, cpu_matmul="onednn"), **quiet)
    finally:
        launch._Loop._step, experts._dispatch = step, dispatch
    return {"eager": eager, "compiled": compiled, "compile_s": compile_seconds(), "graphs": graphs,
            "breaks": dict(counters["graph_break"]), "rows": rows, "saved": sum(saved),
            "onednn": onednn_products()}


def _model_and_layout(case: str) -> tuple[Path, Layout]:
    entry = LAYOUTS[case]
    return entry if isinstance(entry, tuple) else (MODEL, entry)


# make test's representatives (tp, full recompute, the eager ep exchanges; FSDP2's units under --compile:
# test_verify_compile_matches_single_device_at_zero2 below); make test-matrix runs every case
KEEP = ("tp2", "tp2-recompute-full", "mixtral-dp2-ep2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("compiled")
    items = []
    for name in selected_cases(request, LAYOUTS):
        model, layout = _model_and_layout(name)
        compile_model(model, layout, out=folder / name)
        items.append((name, (str(folder / name),)))
    return spawn_cases(_eager_and_compiled, 2, items, timeout=900)


@pytest.fixture(scope="module")
def reference():
    return {model: reference_losses(load_model_file(model), STEPS) for model in (MODEL, MIXTRAL)}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.e2e
@pytest.mark.parametrize("case", matrix(LAYOUTS, KEEP))
def test_compiled_losses_equal_eager_and_single_device(trained, reference, case):
    ranks = case_result(trained, case)
    eager, compiled = ranks[0]["eager"], ranks[0]["compiled"]
    assert all(r["eager"] == ranks[0]["eager"] and r["compiled"] == compiled for r in ranks)  # the step losses
    # compiled for real, no graph break at a collective: the whole forward one graph; under ZeRO 3 one per block
    # class and the module's own, broken only at the block calls (fxshard.runtime.compiled's, FSDP2's hooks);
    # under --ep broken only at the exchanges.  The first step compiles them all; no later step compiles again
    graphs, breaks = ranks[0]["graphs"], ranks[0]["breaks"]
    assert ranks[0]["compile_s"] > 0 and graphs == graphs[:1] * STEPS, ranks[0]
    if case == "dp2-zero3":
        assert 1 <= graphs[0] <= 3 and all("disable" in reason for reason in breaks), breaks
    elif case.startswith("mixtral"):
        exchanges = ("exchange_counts", "all_to_all_dispatch", "all_to_all_combine")
        if case == "mixtral-dp2-ep2":
            assert all(any(f"function `<function {f} at" in reason for f in exchanges) for reason in breaks), breaks
        else:  # also at the calls of the compiled blocks
            assert all("torch.compiler.disable" in reason for reason in breaks), breaks
        # per step and rank, 2 layers x (forward, backward of the combine, and the recompute's forward)
        per_step = 4 if case == "mixtral-dp2-ep2" else 6
        rows = [r["rows"] for r in ranks]
        assert all(len(r) == per_step * STEPS for r in rows), rows
        assert all(len({tuple(r[i:i + per_step]) for i in range(0, len(r), per_step)}) > 1 for r in rows), rows
    else:
        assert graphs[0] == 1 and not breaks, ranks[0]
    # on oneDNN: the 13 linear layers' forward, input- and weight-gradient products of a rank holding every layer,
    # less the one addmm inductor folds a residual add into (its addend is [M, N], not a bias row: left on MKL)
    assert ranks[0]["onednn"] == 3 * 13 - 1 if case in ("tp2", "dp2-zero1") else ranks[0]["onednn"] > 0
    assert _rel(compiled, eager) <= COMPILED_RTOL, (case, eager, compiled)
    single = reference[_model_and_layout(case)[0]]
    assert _rel(eager, single) <= REFERENCE_RTOL and _rel(compiled, single) <= REFERENCE_RTOL


@pytest.mark.e2e
@pytest.mark.matrix
def test_compiled_backward_recomputes(trained):
    """The compiled forward saves less for backward with selective recompute, and less again with full."""
    saved = {case: case_result(trained, case)[0]["saved"] for case in ("tp2", "tp2-recompute-selective",
                                                                        "tp2-recompute-full")}
    assert saved["tp2"] > saved["tp2-recompute-selective"] > saved["tp2-recompute-full"], saved


@pytest.mark.e2e
def test_verify_compile_matches_single_device_at_zero2(tmp_path):
    args = ["verify", MODEL, "--dp", 2, "--zero", 2, "--steps", 2, "--compile", "--out", tmp_path / "v"]
    run = cli(*args, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "compiled in" in run.stdout and re.search(r"of\s+the\s+update[^:]*:\s+OK", run.stdout), run.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("flags", [
    ["--tp", 2, "--sp", "--fp8", "tensorwise"],  # the fused fp8 linears unfused under compile, amaxes over tp
    pytest.param(["--cp", 2, "--fp8", "tensorwise"], marks=pytest.mark.matrix),  # amaxes over cp (funcol's max)
], ids=["tp2-sp", "cp2"])
def test_verify_compile_of_fp8_linears_matches_the_same_recipe_on_one_device(tmp_path, flags):
    """``--fp8`` under ``--compile``: torch.compile traces the fp8 linears' casts, scales and their amax all-reduce
    (``funcol.all_reduce(..., "max")``) with no graph break, and the sharded compiled run matches one device running
    the same recipe eagerly (tp2 sp: losses 1.1e-7 relative; cp2: 5.7e-8)."""
    args = ["verify", MODEL, *flags, "--steps", 2, "--compile", "--out", tmp_path / "v"]
    run = cli(*args, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "compiled in" in run.stdout and "fp8=tensorwise" in run.stdout, run.stdout
    assert re.search(r"of\s+the\s+update[^:]*:\s+OK", run.stdout), run.stdout


def test_compile_refuses_dropout_naming_the_fix(tmp_path):
    out = tmp_path / "drop"
    compile_model(Path(__file__).resolve().parents[1] / "models" / "gpt2_dropout.py", Layout(tp=2), out=out)
    with pytest.raises(OptionError, match=r"--compile: .* dropout .*run it without --compile"):
        check_compile(out)


def test_compile_refuses_random_draws_naming_the_fix(tmp_path):
    out = tmp_path / "draws"
    compile_model(Path(__file__).resolve().parents[1] / "models" / "noisy.py", Layout(tp=2), out=out)
    with pytest.raises(OptionError, match=r"--compile: .* random draws \(rt.draw: .*run it without --compile"):
        check_compile(out)


def test_compile_refuses_the_split_backward_of_zero_bubble(tmp_path):
    out = tmp_path / "zb"
    compile_model(MODEL, Layout(pp=2, schedule="zero-bubble", microbatches=2), out=out)
    with pytest.raises(OptionError, match=r"--compile: .*--schedule zero-bubble .*use 1f1b or interleaved-1f1b"):
        check_compile(out)


@pytest.mark.parametrize("model, layout", [(MODEL, Layout(dp=2, zero=3, recompute="selective")),
                                           (MIXTRAL, Layout(dp=2, ep=2, recompute="selective"))], ids=["zero3", "ep"])
def test_compile_refuses_selective_recompute_around_compiled_blocks(tmp_path, model, layout):
    compile_model(model, layout, out=tmp_path / "out")
    with pytest.raises(OptionError, match=r"--compile: .*--recompute selective with (ZeRO 3|--ep 2) .*the compiled "
                                          r"code calls out to.*; use --recompute full"):
        check_compile(tmp_path / "out")


def test_compile_refuses_a_memory_report_that_would_miss_selective_recomputes_kept_activations(tmp_path):
    from fxshard.train.options import RunOptions, check_run_options

    compile_model(MODEL, Layout(tp=2, recompute="selective"), out=tmp_path / "sel")
    with pytest.raises(OptionError, match=r"--memory-report with --compile: .*--recompute selective.*drop --compile"):
        check_run_options(tmp_path / "sel", RunOptions(steps=1, compile=True, memory_report=True), say=lambda *_: None)
    compile_model(MODEL, Layout(tp=2, recompute="full"), out=tmp_path / "full")  # what full keeps is the block input
    check_run_options(tmp_path / "full", RunOptions(steps=1, compile=True, memory_report=True), say=lambda *_: None)
