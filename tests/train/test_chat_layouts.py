"""Training on a chat token file (``data tokenize --format chat``: a loss mask beside the ids) equals one
device at every layout: the losses (each a token mean over the masked labels of the whole global batch), the
trained parameters and an evaluation of the validation split match single-device training on the same global
batches, one conversation per sequence (right-padded) and packed; and a run saved at dp2 and resumed at tp2
from step 2 gives the uninterrupted run's steps 3 and 4.

Each case is compiled here and trained 4 steps on real gloo process groups (one spawn of 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import assert_matches_single_device

from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import read_manifest
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import CaseFailure, case_result, matrix, selected_cases, spawn_cases
from fxshard.train.checkpoint import CheckpointConfig
from fxshard.train.data import DataOptions
from fxshard.train.optim import OptimConfig
from fxshard.train.reference import reference_losses

pytestmark = pytest.mark.distributed

CHAT = Path(__file__).resolve().parent.parent / "models" / "chat_llama.py"
STEPS, REL, EVAL_BATCHES = 4, 1e-5, 2
OPTIM = OptimConfig(lr=3e-3)
CASES = {  # id -> (layout, packed)
    "chat-tp2": (Layout(tp=2), False),
    "chat-dp2-zero1": (Layout(dp=2, zero=1), False),
    "chat-packed-pp2": (Layout(pp=2), True),
    "chat-packed-tp2": (Layout(tp=2), True),
    "chat-packed-dp2-zero3": (Layout(dp=2, zero=3), True),
    "chat-packed-tp2-pp2-dp2": (Layout(tp=2, pp=2, dp=2), True),
}
KEEP = ("chat-tp2", "chat-dp2-zero1", "chat-packed-pp2")  # make test's; make test-matrix runs every case


def train_on(out: str, steps: int, data: DataOptions, checkpoint: CheckpointConfig | None = None):
    """A spawn target: this rank's losses and trained tensors; rank 0 writes ``out/metrics.jsonl``
    (eval_loss)."""
    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    state: dict = {}
    ckpt = {} if checkpoint is None else {"checkpoint": checkpoint.folder, "resume": checkpoint.resume,
                                          "save_every": checkpoint.save_every}
    options = RunOptions(steps, OPTIM, data, metrics=Path(out) / "metrics.jsonl", eval_every=steps,
                         eval_batches=EVAL_BATCHES, **ckpt)
    return train(Path(out), options, log=lambda *_: None, final_state=state), state


def _data(root: Path, packed: bool) -> DataOptions:
    return DataOptions(data=root / "chat.bin", pack=packed, data_workers=1)


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory, chat_corpus):
    root, _ = chat_corpus
    worlds: dict = {}
    results: dict = {}
    for case in selected_cases(request, CASES):
        layout, packed = CASES[case]
        out = tmp_path_factory.mktemp(case)
        try:
            compile_model(CHAT, layout, out=out)
        except Exception as e:
            results[case] = CaseFailure(f"compile failed: {type(e).__name__}: {e}")
            continue
        worlds.setdefault(layout.world_size, []).append((case, (str(out), STEPS, _data(root, packed)), out))
    for world, items in worlds.items():
        found = spawn_cases(train_on, world, [(case, args) for case, args, _ in items])
        for case, _, out in items:
            results[case] = found[case] if isinstance(found[case], CaseFailure) else \
                (found[case], read_manifest(out), out)
    return results


@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_chat_training_matches_one_device(trained, chat_corpus, case):
    root, _ = chat_corpus
    per_rank, manifest, out = case_result(trained, case)
    layout, packed = CASES[case]
    single: dict = {}
    evals: dict = {}
    want = reference_losses(load_model_file(CHAT), STEPS, OPTIM, final_state=single, data=_data(root, packed),
                            eval_every=STEPS, eval_batches=EVAL_BATCHES, evals=evals)
    assert_matches_single_device(case, CHAT, layout, per_rank, manifest, want, single, REL)
    metrics = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    got = {x["step"]: x["eval_loss"] for x in metrics if "eval_loss" in x}
    assert abs(got[STEPS] - evals[STEPS]) <= REL * abs(evals[STEPS]), f"{case} eval: {got} vs {evals}"


# make test-matrix's: a resume under another layout is tests/test_checkpoint.py's (make test), chat training at each
# layout this file's chat-tp2
@pytest.mark.matrix
def test_saved_at_dp2_and_resumed_at_tp2_mid_run_continues_the_losses(tmp_path, chat_corpus):
    root, _ = chat_corpus
    dp2, tp2 = tmp_path / "dp2", tmp_path / "tp2"
    compile_model(CHAT, Layout(dp=2), out=dp2)
    compile_model(CHAT, Layout(tp=2), out=tp2)
    data = _data(root, packed=False)
    ckpt = tmp_path / "ckpt"
    first = spawn_cases(train_on, 2, [("saved", (str(dp2), STEPS, data, CheckpointConfig(ckpt, 2)))])["saved"]
    assert not isinstance(first, CaseFailure), first.message
    resumed = spawn_cases(train_on, 2, [("resumed", (str(tp2), STEPS, data,
                                                     CheckpointConfig(ckpt / "step-00000002", resume=True)))])
    got = case_result(resumed, "resumed")[0][0]
    want = first[0][0][2:]
    assert len(got) == 2, got
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=3):
        assert abs(g - w) <= REL * abs(w), f"step {step} resumed at tp2: {g} vs uninterrupted {w}"
