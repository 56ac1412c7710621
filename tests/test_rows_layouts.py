"""Models that mix the rows of the batch, and models that draw random numbers, train as on one device.

The row-mixing corpus (``tests/models/rows_*.py``: a router's ``view(2, B*S, -1)``, a reshape across batch and
sequence, flattened rows split at another size, a sum, a sort and a cumulative sum over the batch) trained silently
wrong at --dp 2 before the batch-row analysis (``fxshard/ir/rows.py``); now the ops that mix rows run on the whole
batch (``passes/batch_rows.py``).  ``rows_tiled_heads.py`` (DeBERTa's repeated relative-position keys) splits with
the rows; ``rows_tiled_odd.py`` runs on the whole batch, taken back to the rows inside a layer's class.

The random-op models (``mae_mask.py``: rand + argsort; ``random_ops.py``: randn,
randn_like, randperm, bernoulli_, stochastic depth, exponential_, multinomial; Hugging Face Phimoe's router) were
refused at --dp and --pp; now every rank draws its elements of one device's values (``fxshard/runtime/draws.py``).

Each case is compiled here and trained 3 AdamW steps on real gloo process groups through
``fxshard.train.launch.train`` (the code ``fxshard run`` runs), the cases of one world size in one spawn; losses must
match single-device training (``reference_losses``, whose draws are the same: ``ReferenceDraws``) within 1e-5
relative and the trained parameters within verify's share of the update."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import assert_matches_single_device, single_device

from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import read_manifest
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import case_result, matrix, selected_cases, spawn_cases
from fxshard.train.optim import OptimConfig
from fxshard.train.reference import reference_losses

MODELS = Path(__file__).resolve().parent / "models"
STEPS = 3
REL = 1e-5
ACCUM = OptimConfig(grad_accum=2)
SPLIT = {"blocks.*.fc_in": "colwise", "blocks.*.fc_out": "rowwise"}  # random_ops' draws split over tp
CORPUS = ("rows_router_view", "rows_reshape", "rows_flatten_split", "rows_batch_sum", "rows_batch_sort",
          "rows_batch_cumsum")
CASES = {  # id -> (model file, layout, optimizer settings[, plan])
    **{f"{m.replace('_', '-')}-dp2": (MODELS / f"{m}.py", Layout(dp=2, zero=1), OptimConfig()) for m in CORPUS},
    # whole copies of a parameter tensor in every row (DeBERTa's relative-position keys): split with the rows; and a
    # table tiled across the rows (computed on the whole batch: rt.own_rows inside the layer class, its self.dp)
    "rows-tiled-heads-dp2": (MODELS / "rows_tiled_heads.py", Layout(dp=2, zero=1), OptimConfig()),
    "rows-tiled-heads-pp2": (MODELS / "rows_tiled_heads.py", Layout(pp=2, microbatches=2), OptimConfig()),
    "rows-tiled-odd-dp2": (MODELS / "rows_tiled_odd.py", Layout(dp=2, zero=1), OptimConfig()),
    "mae-dp2": (MODELS / "mae_mask.py", Layout(dp=2, zero=1), OptimConfig()),
    "mae-pp2": (MODELS / "mae_mask.py", Layout(pp=2, microbatches=2), OptimConfig()),
    "mae-tp2": (MODELS / "mae_mask.py", Layout(tp=2), OptimConfig()),
    "random-ops-dp2": (MODELS / "random_ops.py", Layout(dp=2, zero=1), OptimConfig()),
    "random-ops-pp2": (MODELS / "random_ops.py", Layout(pp=2, microbatches=2), OptimConfig()),
    "random-ops-tp2-split": (MODELS / "random_ops.py", Layout(tp=2), OptimConfig(), SPLIT),
    # accumulated batches: each draws with its own batch number, as one device's forwards do
    "random-ops-dp2-accum2": (MODELS / "random_ops.py", Layout(dp=2, zero=1), ACCUM),
    # a schedule interleaving microbatches and stages; recompute draws again in backward, under the forward's key
    "random-ops-pp2-interleaved": (MODELS / "random_ops.py", Layout(pp=2, schedule="interleaved-1f1b",
                                                                     microbatches=4), OptimConfig()),
    "random-ops-pp2-recompute-full": (MODELS / "random_ops.py", Layout(pp=2, microbatches=2, recompute="full"),
                                      OptimConfig()),
    "random-ops-dp2-zero3": (MODELS / "random_ops.py", Layout(dp=2, zero=3), OptimConfig()),
    # draws beside a sequence split over cp: each rank its tokens of one device's values (dp x cp: its rows too)
    "drop-path-cp2": (MODELS / "drop_path_lm.py", Layout(cp=2), OptimConfig()),
    "drop-path-dp2-cp2": (MODELS / "drop_path_lm.py", Layout(dp=2, cp=2), OptimConfig()),
    # Phimoe samples its experts with exponential_ and rand_like over the batch's flattened tokens
    "phimoe-dp2": (MODELS / "hf_phimoe.py", Layout(dp=2, zero=1), OptimConfig()),
    "phimoe-pp2": (MODELS / "hf_phimoe.py", Layout(pp=2), OptimConfig()),
    # under --sp the router's tokens are split in one block per row (S(0)x4): each rank draws its parts of every
    # block (refused before: a check meant for unequal or shared blocks read a method as true)
    "phimoe-tp2-sp": (MODELS / "hf_phimoe.py", Layout(tp=2, sp=True), OptimConfig()),
}
# make test's representatives: every silent row-mixing case, each random-op model at dp or pp, tp with split draws,
# accumulation, Phimoe's router under --sp (its pp2 sibling: random-ops-pp2); make test-matrix runs every case
KEEP = (*(f"{m.replace('_', '-')}-dp2" for m in CORPUS), "rows-tiled-heads-pp2", "rows-tiled-odd-dp2", "mae-pp2",
        "random-ops-pp2", "random-ops-tp2-split", "random-ops-dp2-accum2", "drop-path-cp2", "phimoe-tp2-sp")


def _train_one(out: str, optim: OptimConfig):
    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    state: dict = {}
    return train(Path(out), RunOptions(STEPS, optim), log=lambda *_: None, final_state=state), state


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    folders: dict[int, list] = {}
    for case in selected_cases(request, CASES):
        path, layout, optim, *plan = CASES[case]
        out = tmp_path_factory.mktemp(case)
        compile_model(path, layout, out=out, plan=plan[0] if plan else None)
        folders.setdefault(layout.world_size, []).append((case, (str(out), optim)))
    results = {}
    for world, items in folders.items():
        results |= spawn_cases(_train_one, world, items, timeout=900)
    return {case: (results[case], read_manifest(Path(args[0]))) for items in folders.values()
            for case, args in items}


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_trains_as_on_one_device(trained, case):
    path, layout, optim, *_ = CASES[case]
    result, manifest = trained[case]
    per_rank = case_result({case: result}, case)
    want, single = single_device(path, STEPS, optim)
    assert_matches_single_device(case, path, layout, per_rank, manifest, want, single, REL)


def test_the_draws_are_active_so_the_cases_test_something(tmp_path):
    # the random ops move the loss beyond the layout cases' tolerance at every step (twice it at least; with 4 blocks
    # step 3 moves by 2.4x), and by 10x at one step at least
    quiet = tmp_path / "quiet.py"
    source = (MODELS / "random_ops.py").read_text()
    for noisy, still in (("0.1 * torch.randn(b, s, d", "0.0 * torch.randn(b, s, d"), ("bernoulli_(0.9)", "fill_(1.0)"),
                         ("drop_path(x * weight, 0.2)", "x * weight")):
        assert noisy in source
        source = source.replace(noisy, still)
    quiet.write_text(source)
    with_draws = reference_losses(load_model_file(MODELS / "random_ops.py"), STEPS)
    without = reference_losses(load_model_file(quiet), STEPS)
    moved = [abs(a - b) / abs(b) for a, b in zip(with_draws, without, strict=True)]
    assert min(moved) > 2 * REL and max(moved) > 10 * REL, (with_draws, without)
