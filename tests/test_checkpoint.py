"""Checkpoints: save during training, a kill in the middle of a save, resume under the same and other
layouts (tp, pp, dp and ZeRO stages), export to a Hugging Face folder, and the errors of bad input.

Every run goes through ``fxshard.train.launch.train`` (what ``fxshard run`` runs on each rank) on real gloo
process groups.  The reference is one uninterrupted 4-step run at tp=2·pp=2 that saves at steps 2
and 4; every resumed run starts from its step-2 checkpoint and must reproduce its steps 3 and 4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from harness import spawn

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import matrix, selected_cases
from fxshard.train.checkpoint import CRASH_ENV, CheckpointConfig, CheckpointError, CheckpointReader
from fxshard.train.optim import OptimConfig

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
STEPS = 4
REL = 1e-5
SAVED = "tp2-pp2"
# llama: 8 heads / 4 kv heads, so tp=4 divides both; gpt2: 4 heads
RESUMES = {  # id -> (model, layout): each resumes the tp=2·pp=2 run's step-2 checkpoint
    "gpt2-tp2-pp2": ("gpt2", Layout(tp=2, pp=2)),
    "gpt2-tp4": ("gpt2", Layout(tp=4)),
    "llama-tp4": ("llama", Layout(tp=4)),
    "gpt2-dp2-zero1": ("gpt2", Layout(dp=2, zero=1)),
    "gpt2-dp2-zero3": ("gpt2", Layout(dp=2, zero=3)),
    "llama-dp2-zero0": ("llama", Layout(dp=2)),
    "llama-pp2": ("llama", Layout(pp=2)),
}
KEEP = ("llama-tp4", "gpt2-dp2-zero3")  # make test's representatives; make test-matrix resumes every case


def _train(rank: int, world: int, runs: list, crash_at: int | None = None):
    """Train each ``(out, steps, CheckpointConfig)``; {out: (losses, final state)}."""
    import os

    from harness import run_options

    from fxshard.train.launch import train

    if crash_at is not None:
        os.environ[CRASH_ENV] = str(crash_at)
    results = {}
    for out, steps, ckpt in runs:
        state: dict = {}
        losses = train(Path(out), run_options(steps, OptimConfig(), ckpt), log=lambda *_: None, final_state=state)
        results[out] = (losses, state)
    return results


def _compile(tmp: Path, model: str, layout: Layout, name: str) -> Path:
    out = tmp / name
    if not out.exists():
        compile_model(SAMPLES / f"{model}.py", layout, out=out)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Uninterrupted 4-step tp=2·pp=2 runs of gpt2 and llama, saving at steps 2 and 4: {model: (out, ckpt, losses)}."""
    tmp = tmp_path_factory.mktemp("saved")
    runs = {m: (_compile(tmp, m, Layout(tp=2, pp=2), f"{m}-{SAVED}"), tmp / f"{m}-ckpt") for m in ("gpt2", "llama")}
    per_rank = spawn(_train, 4, [(str(o), STEPS, CheckpointConfig(c, 2)) for o, c in runs.values()], timeout=600)
    return {m: (o, c, per_rank[0][str(o)]) for m, (o, c) in runs.items()} | {"_per_rank": per_rank}


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory, request):
    """The selected cases of RESUMES, resumed from step 2 and run to step 4: {case: losses of steps 3 and 4
    (rank 0)}."""
    tmp = tmp_path_factory.mktemp("resumed")
    by_world: dict[int, list] = {}
    for case in selected_cases(request, RESUMES, "resumed"):
        model, layout = RESUMES[case]
        out = _compile(tmp, model, layout, case)
        ckpt = CheckpointConfig(saved[model][1] / "step-00000002", resume=True)
        by_world.setdefault(layout.world_size, []).append((case, (str(out), STEPS, ckpt)))
    results = {}
    for world, items in by_world.items():
        per_rank = spawn(_train, world, [run for _, run in items], timeout=600)
        results |= {case: per_rank[0][run[0]][0] for case, run in items}
    return results


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=3):
        assert abs(g - w) <= REL * abs(w), f"{what} step {step}: {g} vs uninterrupted {w}"


@pytest.mark.distributed
def test_uninterrupted_run_saves_and_commits_latest(saved):
    for model in ("gpt2", "llama"):
        _, ckpt, (losses, _) = saved[model]
        assert len(losses) == STEPS
        assert (ckpt / "latest").read_text().strip() == "step-00000004"
        # .lock stays: the flock'ed file of the run writing the folder (removing it would race a second run)
        assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "latest", "step-00000002", "step-00000004"]
        reader = CheckpointReader(ckpt)
        assert reader.step == 4 and reader.index["layout"]["tp"] == 2 and reader.index["layout"]["pp"] == 2
        assert len(list(reader.path.glob("shard-*.safetensors"))) == 4


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(RESUMES, KEEP))
def test_resume_under_any_layout_continues_the_losses(saved, resumed, case):
    model = RESUMES[case][0]
    _close(resumed[case], saved[model][2][0][2:], f"{case} resumed from {model} {SAVED}")


@pytest.mark.distributed
def test_resume_at_the_saving_layout_is_exact(saved, resumed):
    assert resumed["gpt2-tp2-pp2"] == saved["gpt2"][2][0][2:]


@pytest.mark.distributed
# make test-matrix: make test kills mid-save through the command line (tests/cli/test_supervision.py)
@pytest.mark.matrix
def test_killed_mid_save_leaves_the_previous_checkpoint_and_resume_reaches_the_same_losses(saved, tmp_path):
    out = saved["gpt2"][0]
    ckpt = tmp_path / "ckpt"
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException, AssertionError)):
        spawn(_train, 4, [(str(out), STEPS, CheckpointConfig(ckpt, 2))], 4, timeout=600)
    # rank 0 died after writing its shard of step 4: a partial folder, latest still on step 2
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    partial = [p for p in ckpt.iterdir() if p.name.startswith("step-00000004.tmp-")]
    assert partial and not (partial[0] / "index.json").exists()
    assert CheckpointReader(ckpt).step == 2
    per_rank = spawn(_train, 4, [(str(out), STEPS, CheckpointConfig(ckpt, 2, resume=True))], timeout=600)
    _close(per_rank[0][str(out)][0], saved["gpt2"][2][0][2:], "resumed after the kill")
    assert (ckpt / "latest").read_text().strip() == "step-00000004"
    assert not partial[0].exists()  # the next complete save drops partial folders


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_export_round_trip_is_bit_identical(saved, tmp_path, model):
    from transformers import AutoModelForCausalLM

    from fxshard.check.verify import gather_parameters
    from fxshard.codegen.manifest import read_manifest
    from fxshard.train.export import export_hf

    out, ckpt, _ = saved[model]
    export_hf(ckpt, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # the trained weights as the ranks held them at the end of the uninterrupted run
    folder = tmp_path / "final"
    folder.mkdir()
    from safetensors.torch import save_file

    for rank, result in enumerate(saved["_per_rank"]):
        save_file({k: v.contiguous() for k, v in result[str(out)][1].items()}, str(folder / f"rank{rank}.safetensors"))
    trained = gather_parameters(read_manifest(out), folder)
    reader = CheckpointReader(ckpt)
    params = {reader.canonical(name): p for name, p in loaded.named_parameters()}  # tied: one of its names
    assert set(trained) == set(params)
    for name, want in trained.items():
        assert torch.equal(params[name].detach(), want), name
    assert torch.equal(loaded.lm_head.weight.detach(), trained["lm_head.weight"])
    if model == "gpt2":  # tied: the head is the embedding
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def _resume_error(out: Path, ckpt: Path, allow_changed_model: bool = False) -> str:
    config = CheckpointConfig(ckpt, resume=True, allow_changed_model=allow_changed_model)
    with pytest.raises(AssertionError) as e:  # the harness reports the rank's traceback
        spawn(_train, 1, [(str(out), STEPS, config)], timeout=300)
    return str(e.value)


@pytest.mark.distributed
def test_a_tensor_missing_from_the_checkpoint_names_file_and_tensor(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["gpt2"][1] / "step-00000002", ckpt)
    shard = ckpt / "shard-pp0-tp0.safetensors"
    tensors = load_file(str(shard))
    victim = next(k for k in sorted(tensors) if k.startswith("transformer.h.0.ln_1.weight|param|"))
    del tensors[victim]
    save_file(tensors, str(shard))
    out = _compile(tmp_path, "gpt2", Layout(), "gpt2-single")
    msg = _resume_error(out, ckpt)  # the index recorded the shard's size and header: another file is named as such
    assert "CheckpointError" in msg and str(shard) in msg
    assert "the file is not the one saved with this checkpoint" in msg
    index = json.loads((ckpt / "index.json").read_text())
    del index["files"]  # as a checkpoint saved before fxshard recorded its shards: the missing tensor is named
    (ckpt / "index.json").write_text(json.dumps(index))
    msg = _resume_error(out, ckpt)
    assert "CheckpointError" in msg and str(shard) in msg and "transformer.h.0.ln_1.weight" in msg


@pytest.mark.distributed
def test_a_checkpoint_of_another_model_is_refused(saved, tmp_path):
    """First by the model file's digest; with --allow-changed-model, by the parameters the checkpoint lacks."""
    out = _compile(tmp_path, "llama", Layout(), "llama-single")
    msg = _resume_error(out, saved["gpt2"][1])
    assert "saved from another model file" in msg and "--allow-changed-model" in msg
    msg = _resume_error(out, saved["gpt2"][1], allow_changed_model=True)
    assert "different model" in msg and "model.embed_tokens.weight" in msg and "is missing" in msg


def test_reader_errors_name_the_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        CheckpointReader(tmp_path)
    (tmp_path / "latest").write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match="damaged"):
        CheckpointReader(tmp_path)


@pytest.mark.distributed
def test_index_records_slices_of_the_saving_layout(saved):
    index = json.loads((saved["gpt2"][1] / "step-00000002" / "index.json").read_text())
    c_attn = index["tensors"]["transformer.h.0.attn.c_attn.weight"]
    assert {p["slice"]["blocks"] for p in c_attn["pieces"]} == {3}  # the packed q/k/v split
    assert len(c_attn["pieces"]) == 2 and index["step"] == 2


DP_SAVES = {  # id -> (model, layout): saving under data parallelism (ZeRO owners, FSDP2 shards, bf16 masters)
    "gpt2-dp2-zero1": ("gpt2", Layout(dp=2, zero=1)),
    "llama-dp2-zero3": ("llama", Layout(dp=2, zero=3)),
    "gpt2-dp2-zero1-bf16": ("gpt2", Layout(dp=2, zero=1, dtype="bf16")),
}
DP_RESUMES = {  # id -> (saved case, layout to resume under, relative tolerance)
    "gpt2-dp2-zero1->tp2": ("gpt2-dp2-zero1", Layout(tp=2), REL),
    "llama-dp2-zero3->tp2": ("llama-dp2-zero3", Layout(tp=2), REL),
    "llama-dp2-zero3->dp2-zero3": ("llama-dp2-zero3", Layout(dp=2, zero=3), 0.0),
    "gpt2-bf16-dp2-zero1->same": ("gpt2-dp2-zero1-bf16", Layout(dp=2, zero=1, dtype="bf16"), 0.0),
    # bf16 losses round to 8 significant bits; another ZeRO stage sums in another order (as in test_training_layouts)
    "gpt2-bf16-dp2-zero1->dp2-zero3": ("gpt2-dp2-zero1-bf16", Layout(dp=2, zero=3, dtype="bf16"), 2e-2),
}


@pytest.mark.distributed
@pytest.mark.matrix  # make test-matrix: make test resumes the tp·pp checkpoint under other layouts (above)
def test_saved_under_data_parallelism_resumes_under_other_layouts(tmp_path):
    saves = {c: (_compile(tmp_path, m, lay, c), tmp_path / f"{c}-ckpt") for c, (m, lay) in DP_SAVES.items()}
    first = spawn(_train, 2, [(str(o), STEPS, CheckpointConfig(ck, 2)) for o, ck in saves.values()], timeout=600)
    runs = []
    for case, (saved_case, layout, _) in DP_RESUMES.items():
        out = _compile(tmp_path, DP_SAVES[saved_case][0], layout, case.replace(">", ""))
        runs.append((str(out), STEPS, CheckpointConfig(saves[saved_case][1] / "step-00000002", resume=True)))
    again = spawn(_train, 2, runs, timeout=600)
    for (case, (saved_case, _, rel)), run in zip(DP_RESUMES.items(), runs, strict=True):
        want = first[0][str(saves[saved_case][0])][0][2:]
        got = again[0][run[0]][0]
        assert len(got) == 2, case
        for step, (g, w) in enumerate(zip(got, want, strict=True), start=3):
            assert abs(g - w) <= rel * abs(w), f"{case} step {step}: {g} vs uninterrupted {w}"


@pytest.mark.distributed
def test_export_of_a_plain_torch_model_writes_its_state_dict(tmp_path):
    from safetensors.torch import load_file

    from fxshard.train.export import export_hf

    out = _compile(tmp_path, "gpt", Layout(), "gpt-single")
    spawn(_train, 1, [(str(out), 2, CheckpointConfig(tmp_path / "ckpt", 2))], timeout=300)
    export_hf(tmp_path / "ckpt", tmp_path / "plain")
    exported = load_file(str(tmp_path / "plain" / "model.safetensors"))
    reader = CheckpointReader(tmp_path / "ckpt")
    assert set(map(reader.canonical, exported)) == set(reader.sources)
    for name, value in exported.items():
        assert torch.equal(value, reader.tensor(name)), name


@pytest.mark.distributed
def test_export_with_the_model_of_another_checkpoint_is_refused(saved, tmp_path):
    from fxshard.train.export import export_hf

    with pytest.raises(CheckpointError, match="does not fit .*llama.py: tensor model.embed_tokens.weight is missing"):
        export_hf(saved["gpt2"][1], tmp_path / "hf", SAMPLES / "llama.py")
