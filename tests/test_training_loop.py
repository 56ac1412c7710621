"""The training path, end to end on real gloo process groups of 4 ranks, against single-device training:

- LR schedules, 1-D parameters spared by weight decay, gradient accumulation over the stream, clipping and evaluation
  (``--eval-every``), at tp2·dp2 ZeRO 1 and pp2·dp2 ZeRO 3 (the forward-only pipeline schedule): losses, eval
  losses and trained parameters as one device's (:func:`fxshard.train.reference.reference_losses`);
- resume: an uninterrupted 12-step run saves at step 7; resumed from there in the same layout it repeats steps
  8-12 bit for bit, at pp2·dp2 within 1e-6, and from the same checkpoint stripped to the format before the data
  position was recorded it still resumes, with a note, replaying the stream;
- samples/own_loop.py (``fxshard.load``, a DataLoader, torch's LambdaLR) gives ``fxshard run``'s losses, in a
  spawned rank and launched by torchrun as its docstring says.

Two spawns of 4 processes, and a torchrun and an `fxshard run` of 2; the model (tests/models/llama_stream.py) reads
a map-style dataset of 30 rows through fxshard.train.data (each dp rank its rows, shuffled anew each epoch).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import assert_matches_single_device

from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import read_manifest
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import case_result, spawn_cases
from fxshard.train.data import DataOptions
from fxshard.train.optim import OptimConfig
from fxshard.train.options import RunOptions
from fxshard.train.reference import reference_losses
from fxshard.train.schedule import lr_schedule

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "cli"))
from test_checkpoint_cli import fxshard  # noqa: E402

MODEL = ROOT / "tests" / "models" / "llama_stream.py"
STEPS, EVERY, EVAL_BATCHES = 4, 2, 2
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, clip_grad_norm=1.0, grad_accum=2, lr_schedule="cosine", warmup_steps=1,
                    min_lr=3e-4)
EXACT = {"tp2-dp2-zero1": Layout(tp=2, dp=2, zero=1), "pp2-dp2-zero3": Layout(pp=2, dp=2, zero=3)}
RESUME = OptimConfig(lr=3e-3, weight_decay=0.1, lr_schedule="wsd", warmup_steps=2, decay_steps=4)
OWN = OptimConfig(lr=3e-3, weight_decay=0.1, clip_grad_norm=1.0, lr_schedule="cosine", warmup_steps=2)
SAVED_AT, LAST = 7, 12
QUIET = DataOptions(data_workers=0)  # loading in the rank: 4 ranks on this machine's cores
AHEAD = DataOptions(data_workers=1)  # a worker loading ahead: the saved position is what was trained, not loaded


def _run(kind: str, *args):
    return _own_loop(*args) if kind == "own-loop" else _train(*args)


def _train(out: str, options: RunOptions) -> tuple[list[float], dict, list[str]]:
    """``fxshard run``'s training of ``out``: this rank's losses, trained tensors and what rank 0 printed."""
    from fxshard.train.launch import train

    lines: list[str] = []
    state: dict = {}
    losses = train(Path(out), options, log=lines.append, final_state=state)
    return losses, state, lines


def _own_loop(out: str, steps: int) -> list[float]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("own_loop", ROOT / "samples" / "own_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(out, steps=steps, lr=OWN.lr, warmup=OWN.warmup_steps, log=lambda *_: None)


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _compiled(tmp: Path, name: str, layout: Layout) -> Path:
    out = tmp / name
    if not out.exists():
        compile_model(MODEL, layout, out=out)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One spawn of 4: the exactness cases, the uninterrupted 12-step run saving at step 7, samples/own_loop.py and
    fxshard run's training of the same batches."""
    tmp = tmp_path_factory.mktemp("loop")
    outs = {name: _compiled(tmp, name, layout) for name, layout in EXACT.items()}
    tp2dp2 = _compiled(tmp, "tp2-dp2", Layout(tp=2, dp=2))
    items = [(name, ("run", str(out), RunOptions(STEPS, OPTIM, QUIET, metrics=tmp / f"{name}.jsonl",
                                                 eval_every=EVERY, eval_batches=EVAL_BATCHES)))
             for name, out in outs.items()]
    items.append(("uninterrupted", ("run", str(tp2dp2), RunOptions(LAST, RESUME, AHEAD, checkpoint=tmp / "ckpt",
                                                                    save_every=SAVED_AT))))
    items.append(("run-like-own-loop", ("run", str(tp2dp2), RunOptions(6, OWN, DataOptions(data_workers=0,
                                                                                             shuffle=False)))))
    items.append(("own-loop", ("own-loop", str(tp2dp2), 6)))
    found = spawn_cases(_run, 4, items)
    return {"tmp": tmp, "outs": outs, "tp2dp2": tp2dp2, "found": found}


@pytest.fixture(scope="module")
def resumed(trained):
    """One spawn of 4: steps 8-12 from the step-7 checkpoint, in the same layout, at pp2·dp2, and from the same
    checkpoint in the format before the data position and schedule were recorded."""
    case_result(trained["found"], "uninterrupted")
    tmp = trained["tmp"]
    saved = tmp / "ckpt" / f"step-{SAVED_AT:08d}"
    runs = {}
    for name in ("same", "pp2-dp2", "old-format"):
        folder = tmp / f"resume-{name}"
        shutil.copytree(saved, folder / saved.name)
        (folder / "latest").write_text(saved.name + "\n")
        runs[name] = folder
    index = runs["old-format"] / saved.name / "index.json"
    old = json.loads(index.read_text())
    del old["trainer"]
    old["optimizer"] = {k: v for k, v in old["optimizer"].items()  # the fields of fxshard-checkpoint/1 before it
                        if k in ("lr", "beta1", "beta2", "eps", "weight_decay", "clip_grad_norm", "grad_accum",
                                 "zero_bucket_mb", "overlap_param_gather")}
    index.write_text(json.dumps(old, indent=1))
    pp2dp2 = _compiled(tmp, "pp2-dp2", Layout(pp=2, dp=2))
    layouts = {"same": trained["tp2dp2"], "pp2-dp2": pp2dp2, "old-format": trained["tp2dp2"]}
    return spawn_cases(_run, 4, [(name, ("run", str(layouts[name]), RunOptions(
        LAST, RESUME, AHEAD, checkpoint=runs[name], resume=True))) for name in runs])


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(EXACT))
def test_schedules_weight_decay_accumulation_and_eval_match_one_device(trained, case):
    per_rank = case_result(trained["found"], case)
    single: dict = {}
    evals: dict = {}
    want = reference_losses(load_model_file(MODEL), STEPS, OPTIM, final_state=single, data=QUIET, eval_every=EVERY,
                            eval_batches=EVAL_BATCHES, evals=evals)
    assert_matches_single_device(case, MODEL, EXACT[case], per_rank, read_manifest(trained["outs"][case]), want,
                                 single, 1e-5)
    lines = [json.loads(x) for x in (trained["tmp"] / f"{case}.jsonl").read_text().splitlines()]
    got = {x["step"]: x["eval_loss"] for x in lines if "eval_loss" in x}
    assert set(got) == set(evals) == {2, 4}
    for step, value in got.items():
        assert abs(value - evals[step]) <= 1e-5 * abs(evals[step]), f"{case} eval after step {step}"
    print(f"{case}: losses {_worst(per_rank[0][0], want):.1e}, eval losses "
          f"{_worst([got[s] for s in sorted(got)], [evals[s] for s in sorted(evals)]):.1e} relative to one device")
    lrs = [x["lr"] for x in lines]
    assert lrs == [OPTIM.lr * lr_schedule(OPTIM, STEPS)(s) for s in range(STEPS)]  # LambdaLR's product, to the bit
    assert lrs == pytest.approx([OPTIM.lr * f for f in (0.5, 1.0, 0.775, 0.325)])  # warmup (s+1)/2, cosine to 0.1


# make test-matrix's (one spawn of 4 ranks): a run resumed from its data position, bit for bit in the same layout
# and resharded, is tests/train/test_resume_killed.py's through the command line
@pytest.mark.distributed
@pytest.mark.matrix
def test_a_resumed_run_continues_with_the_next_batch(trained, resumed):
    uninterrupted = case_result(trained["found"], "uninterrupted")[0][0]
    assert len(uninterrupted) == LAST
    same = case_result(resumed, "same")[0][0]
    assert same == uninterrupted[SAVED_AT:]  # bit for bit
    resharded = case_result(resumed, "pp2-dp2")[0][0]
    worst = _worst(resharded, uninterrupted[SAVED_AT:])
    assert worst <= 1e-6, f"pp2-dp2 resumed: {worst:.2e} from the uninterrupted tp2-dp2 run"
    print(f"resumed at step {SAVED_AT}: tp2-dp2 bit for bit, pp2-dp2 {worst:.1e} relative")


@pytest.mark.distributed
@pytest.mark.matrix
def test_a_checkpoint_without_a_data_position_resumes_with_a_note(trained, resumed):
    losses, _, lines = case_result(resumed, "old-format")[0]
    assert any("records no data position" in line and "past 7 batches (7 steps of 1)" in line for line in lines), lines
    assert losses == case_result(trained["found"], "uninterrupted")[0][0][SAVED_AT:]


@pytest.mark.distributed
def test_samples_own_loop_gives_fxshard_runs_losses(trained):
    own = case_result(trained["found"], "own-loop")
    run = case_result(trained["found"], "run-like-own-loop")
    for rank in range(4):
        assert own[rank] == run[rank][0], f"rank {rank}"
    assert len(set(map(tuple, own))) == 1  # the same whole-batch loss on every rank


@pytest.mark.e2e
def test_samples_own_loop_under_torchrun_gives_fxshard_runs_losses(tmp_path):
    """The sample as its docstring launches it, by torchrun (2 ranks at dp2), against `fxshard run` of the same
    folder with the sample's recipe: the same losses and learning rates, bit for bit."""
    out = _compiled(tmp_path, "dp2", Layout(dp=2))
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               *map(str, (ROOT / "samples" / "own_loop.py", out, "--steps", 6, "--metrics",
                                          tmp_path / "own.jsonl"))],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert torchrun.returncode == 0, torchrun.stdout + torchrun.stderr
    assert "step 6/6" in torchrun.stdout  # the sample's metrics print
    fxshard("run", out, "--steps", 6, "--lr", OWN.lr, "--weight-decay", OWN.weight_decay, "--clip-grad-norm",
            OWN.clip_grad_norm, "--lr-schedule", OWN.lr_schedule, "--warmup-steps", OWN.warmup_steps, "--no-shuffle",
            "--data-workers", 0, "--metrics", tmp_path / "run.jsonl")
    own, run = ([json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                for name in ("own", "run"))
    assert [(x["step"], x["loss"], x["lr"]) for x in own] == [(x["step"], x["loss"], x["lr"]) for x in run]
    print(f"samples/own_loop.py under torchrun: {len(own)} losses bit for bit fxshard run's")
