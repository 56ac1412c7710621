"""Training with dropout on equals single-device training with dropout on, under every layout.

GPT-2 (``tests/models/gpt2_dropout.py``: dropout p=0.1 on the embedding, the attention probabilities,
the residual and the MLP) is trained 3 AdamW steps on real gloo process groups through
``fxshard.train.launch.train``; losses must match ``reference_losses`` of the unmodified model within 1e-5
relative.  That holds only if every rank draws, for each element it holds, the mask the element has
on one device: tp slices (attention dropout is split by heads), dp shares of the batch, pipeline
microbatches in any schedule order, batches accumulated into one step.  As in
``test_training_layouts.py``, the cases of one world size share one set of spawned processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.capture.modelfile import load_model_file
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import case_result, matrix, selected_cases, spawn_cases
from fxshard.train.optim import OptimConfig
from fxshard.train.reference import reference_losses

MODEL = Path(__file__).resolve().parent / "models" / "gpt2_dropout.py"
STEPS = 3
REL = 1e-5
ACCUM = OptimConfig(grad_accum=2)
CASES = {  # id -> (layout, optimizer settings)
    "tp2": (Layout(tp=2), OptimConfig()),
    "pp2-1f1b": (Layout(pp=2, schedule="1f1b", microbatches=2), OptimConfig()),
    # schedules that interleave microbatches and stages: each stage still computes microbatch i as i
    "pp2-interleaved-1f1b": (Layout(pp=2, schedule="interleaved-1f1b", microbatches=4), OptimConfig()),
    "pp2-zero-bubble": (Layout(pp=2, schedule="zero-bubble", microbatches=4), OptimConfig()),
    "dp2-zero1": (Layout(dp=2, zero=1), OptimConfig()),
    "dp2-zero1-accum2": (Layout(dp=2, zero=1), ACCUM),
    "dp2-tp2": (Layout(dp=2, tp=2), OptimConfig()),
    "tp2-pp2": (Layout(tp=2, pp=2), OptimConfig()),
    # a sample's row in the whole batch = dp share + microbatch within it
    "dp2-pp2-zero1": (Layout(dp=2, pp=2, zero=1, microbatches=2), OptimConfig()),
    # recompute reruns a block's dropouts in backward, after the schedule moved on to later microbatches
    "pp2-1f1b-recompute-full": (Layout(pp=2, microbatches=4, recompute="full"), OptimConfig()),
    "tp2-dp2-zero3-recompute-selective": (Layout(tp=2, dp=2, zero=3, recompute="selective"), OptimConfig()),
    # --sp: the embedding's and the residual dropouts run on this rank's S/tp tokens, each drawing its slice of
    # the single-device mask (attention dropout stays split by heads)
    "tp2-sp": (Layout(tp=2, sp=True), OptimConfig()),
    "tp2-pp2-sp": (Layout(tp=2, pp=2, sp=True), OptimConfig()),
    "tp2-dp2-zero1-sp-recompute-selective": (Layout(tp=2, dp=2, zero=1, sp=True, recompute="selective"),
                                             OptimConfig()),
}


def _train_one(out: str, optim: OptimConfig) -> list[float]:
    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    return train(Path(out), RunOptions(STEPS, optim), log=lambda *_: None)


# make test's representatives (an interleaved schedule, ZeRO 3 with selective recompute, tp·pp with sp); make
# test-matrix runs every case
KEEP = ("pp2-interleaved-1f1b", "tp2-dp2-zero3-recompute-selective", "tp2-pp2-sp")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    """Compile the selected cases and train each world size's cases in one spawn; {case: per-rank losses or
    CaseFailure}."""
    folders: dict[int, list[tuple[str, Path, OptimConfig]]] = {}
    for case in selected_cases(request, CASES):
        layout, optim = CASES[case]
        out = tmp_path_factory.mktemp(case)
        compile_model(MODEL, layout, out=out)
        folders.setdefault(layout.world_size, []).append((case, out, optim))
    results = {}
    for world, items in folders.items():
        results |= spawn_cases(_train_one, world, [(case, (str(o), opt)) for case, o, opt in items])
    return results


_REFERENCE: dict = {}


def _reference(path: Path, optim: OptimConfig) -> list[float]:
    if (path, optim) not in _REFERENCE:
        _REFERENCE[path, optim] = reference_losses(load_model_file(path), STEPS, optim)
    return _REFERENCE[path, optim]


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_training_with_dropout_matches_single_device(trained, case):
    want = _reference(MODEL, CASES[case][1])
    for rank, losses in enumerate(case_result(trained, case)):
        for step, (got, ref) in enumerate(zip(losses, want, strict=True), start=1):
            assert abs(got - ref) <= REL * abs(ref), f"{case} rank {rank} step {step}: {got} vs {ref}"


def test_dropout_is_active_so_the_cases_test_something(tmp_path):
    off = tmp_path / "gpt2_no_dropout.py"
    off.write_text(MODEL.read_text().replace("P = 0.1", "P = 0.0"))
    with_dropout = _reference(MODEL, OptimConfig())
    without = _reference(off, OptimConfig())
    # at least 10x the tolerance of the layout cases at every step (a fresh GPT-2's loss is near ln 256 either way)
    assert all(abs(a - b) > 10 * REL * abs(b) for a, b in zip(with_dropout, without, strict=True)), \
        (with_dropout, without)
