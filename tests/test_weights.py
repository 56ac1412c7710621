"""Weights from a Hugging Face folder (``--weights DIR``): capture on meta, each rank reads only its slices.

Tiny ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` checkpoints are written here with ``save_pretrained``
(single file, and sharded with an index).  The model files build the model from the folder's config
without its weights; fxshard compiles them on meta tensors and the ranks read their slices at run time.
Checked: every local tensor equals its slice of the saved tensor, a rank reads only its share of the
bytes, training equals single-device training of ``from_pretrained`` (tp=2 with GPT-2's packed
``c_attn``; tp=2 x pp=2 Llama from a sharded folder; bf16 mixed precision), and bad folders fail
at compile time with errors naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import spawn
from safetensors.torch import load_file, save_file, save_model

from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import RankEntry, WeightsSource, import_rank_file, read_manifest
from fxshard.driver import compile as compile_model
from fxshard.errors import OutputFolderError, WeightsError
from fxshard.ir.context import Layout
from fxshard.ir.placement import take
from fxshard.runtime import load_state
from fxshard.testing import cli
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
REL = 1e-5
BF16_REL = 2e-2

MODEL_FILE = '''import torch
from transformers import AutoConfig, AutoModelForCausalLM

DIR = {folder!r}


def make_model():  # the configuration of the folder, random weights: fxshard captures it on meta tensors
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR))


def make_inputs():
    ids = torch.randint(0, 256, (4, 16))
    return {{"input_ids": ids, "labels": ids.clone(), "use_cache": False}}
'''


def _model_file(folder: Path) -> Path:
    path = folder.parent / f"{folder.name}_model.py"
    path.write_text(MODEL_FILE.format(folder=str(folder)))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Checkpoints saved with save_pretrained (seed 3: not the weights make_model() would draw)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    llama = load_model_file(ROOT / "samples" / "llama.py").module
    gpt2 = load_model_file(ROOT / "samples" / "gpt2.py").module

    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(3)
    llama_model = LlamaForCausalLM(llama.config())
    llama_model.save_pretrained(root / "llama")
    llama_model.save_pretrained(root / "llama_sharded", max_shard_size="100KB")
    GPT2LMHeadModel(gpt2.config()).save_pretrained(root / "gpt2")
    assert (root / "llama_sharded" / "model.safetensors.index.json").is_file()
    # a plain PyTorch model (samples/gpt.py, tied embedding), saved without transformers
    (root / "gpt").mkdir()
    save_model(load_model_file(ROOT / "samples" / "gpt.py").build_model(seed=5),
               str(root / "gpt" / "model.safetensors"))
    return {name: root / name for name in ("llama", "llama_sharded", "gpt2", "gpt")}


def _full_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors


def _load_rank(out: Path, entry: RankEntry, monkeypatch) -> tuple[torch.nn.Module, list[tuple[str, int]]]:
    """Build a rank's module and load it, recording every checkpoint read (name, bytes)."""
    import fxshard.runtime.slices as slices

    reads = []
    original = slices.read_slice

    def recorded(spec):
        value = original(spec)
        reads.append((spec["name"], value.numel() * value.element_size()))
        return value

    monkeypatch.setattr(slices, "read_slice", recorded)
    module = import_rank_file(out / entry.file).RankModule({a: None for a in ("dp", "pp", "tp")})
    load_state(module, out / entry.weights)
    return module, reads


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "llama_sharded", "gpt2", "gpt"])
def test_each_rank_holds_its_slices_and_reads_only_them(folders, name, tmp_path, monkeypatch):
    folder = folders[name]
    model = ROOT / "samples" / "gpt.py" if name == "gpt" else _model_file(folder)
    result = compile_model(model, Layout(tp=2), out=tmp_path, weights=folder)
    manifest = result.manifest
    assert manifest.weights.dir == str(folder)
    full = _full_tensors(folder)
    total = sum(t.numel() * t.element_size() for t in full.values())
    for entry in manifest.ranks:
        module, reads = _load_rank(tmp_path, entry, monkeypatch)
        own = dict(module.named_parameters()) | dict(module.named_buffers())
        expected_bytes = 0
        for key, t in entry.tensors.items():
            if t.kind != "parameter":
                continue
            ref = t.checkpoint.name
            want = take(full[ref], t.slice)
            assert torch.equal(own[key], want), f"{name} {entry.file}: {key} is not its slice of {ref}"
            expected_bytes += want.numel() * want.element_size()
        # never the full tensor: every read of a split tensor is its 1/tp share, and the rank's bytes add up
        split = {t.checkpoint.name for t in entry.tensors.values() if t.checkpoint and t.slice.parts > 1}
        for ref, nbytes in reads:
            if ref in split:
                assert nbytes * 2 == full[ref].numel() * full[ref].element_size(), ref
        assert sum(b for _, b in reads) == expected_bytes
        assert expected_bytes < 0.75 * total
    # the rank shards hold only buffers (rotary tables); the parameters stay in the folder
    assert all((tmp_path / e.weights).stat().st_size < 64 * 1024 for e in manifest.ranks)


def _train_all(rank: int, world: int, outs: list[str]):
    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    return {out: train(Path(out), RunOptions(STEPS), log=lambda *_: None) for out in outs}


def _pretrained_losses(model_file: Path, folder: Path, dtype: str = "fp32") -> list[float]:
    from transformers import AutoModelForCausalLM

    mf = load_model_file(model_file)
    mf = dataclasses.replace(mf, make_model=lambda: AutoModelForCausalLM.from_pretrained(folder))
    return reference_losses(mf, STEPS, dtype=dtype)


@pytest.mark.distributed
def test_training_from_a_folder_equals_from_pretrained(folders, tmp_path):
    cases = {  # id -> (folder, layout)
        "gpt2-tp2": ("gpt2", Layout(tp=2)),
        "gpt2-tp2-bf16": ("gpt2", Layout(tp=2, dtype="bf16")),
        "llama-sharded-tp2-pp2": ("llama_sharded", Layout(tp=2, pp=2)),
        "gpt2-tp2-pp2-tied": ("gpt2", Layout(tp=2, pp=2)),  # lm_head on the last stage reads the embedding
    }
    by_world: dict[int, list[str]] = {}
    for case, (name, layout) in cases.items():
        out = tmp_path / case
        compile_model(_model_file(folders[name]), layout, out=out, weights=folders[name])
        by_world.setdefault(layout.world_size, []).append(str(out))
    losses = {}
    for world, outs in by_world.items():
        per_rank = spawn(_train_all, world, outs, timeout=600)
        losses |= {out: per_rank[0][out] for out in outs}
    for case, (name, layout) in cases.items():
        want = _pretrained_losses(_model_file(folders[name]), folders[name], layout.dtype)
        got = losses[str(tmp_path / case)]
        rel = BF16_REL if layout.mixed else REL
        for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
            assert abs(g - w) <= rel * abs(w), f"{case} step {step}: {g} vs from_pretrained {w}"


def test_meta_compile_without_weights_writes_code_and_fails_clearly_at_run(folders, tmp_path, monkeypatch):
    result = compile_model(ROOT / "samples" / "llama.py", Layout(tp=2), out=tmp_path, meta=True)
    assert result.manifest.weights == WeightsSource(None, {})
    assert (tmp_path / "rank_pp0_tp1.py").is_file()
    with pytest.raises(OutputFolderError, match="compiled without weights.*--weights DIR"):
        _load_rank(tmp_path, result.manifest.ranks[0], monkeypatch)


def _copy(folder: Path, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    return copy


def test_missing_tensor_names_it(folders, tmp_path):
    folder = _copy(folders["llama"], tmp_path, "missing")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"tensor model\.layers\.1\.mlp\.down_proj\.weight is missing.*"
                                           r"model\.safetensors"):
        compile_model(_model_file(folder), Layout(tp=2), weights=folder)


def test_shape_that_disagrees_with_the_config_names_file_and_tensor(folders, tmp_path):
    folder = _copy(folders["llama"], tmp_path, "reshaped")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96  # the model file builds from this config; the tensors say 128
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.gate_proj\.weight "
                                           r"has shape \[128, 64\], the model \(its config\) expects \[96, 64\]"):
        compile_model(_model_file(folder), Layout(tp=2), weights=folder)


def test_truncated_file_names_file_and_tensor(folders, tmp_path):
    folder = _copy(folders["llama_sharded"], tmp_path, "truncated")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    victim = index["model.layers.2.self_attn.o_proj.weight"]
    data = (folder / victim).read_bytes()
    (folder / victim).write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=rf"{victim}: cannot read the safetensors file \(needed for tensor "
                                           r"model\.layers\.2\..*truncated"):
        compile_model(_model_file(folder), Layout(tp=2), weights=folder)


def test_checkpoint_of_a_different_model_is_rejected(folders):
    with pytest.raises(WeightsError, match=r"config\.json: model_type is 'gpt2', the model file's model "
                                           r"\(LlamaForCausalLM\) has 'llama': a checkpoint of a different model"):
        compile_model(ROOT / "samples" / "llama.py", Layout(tp=2), weights=folders["gpt2"])


@pytest.mark.slow
def test_70b_shaped_llama_compiles_on_meta_without_allocating(tmp_path):
    """4 layers of the 70B shape at tp=8 pp=4: ~19 GB of fp32 parameters if they were allocated."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_scaling", "4", "8", "4", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["rank_files"] == 32
    assert row["peak_rss_mb"] < 1500, row
    manifest = read_manifest(tmp_path / "out4")
    entry = manifest.ranks[0].tensors["Stage0.model_embed_tokens_weight"]
    assert entry.global_shape == (128256, 8192) and entry.shape == (16032, 8192)
    assert not entry.in_shard and entry.checkpoint is None and manifest.weights.dir is None


@pytest.mark.e2e
def test_command_line_compile_with_weights_and_run(folders, tmp_path):
    def fxshard(*args):
        return cli(*args, timeout=600, cwd=ROOT)

    model, out = _model_file(folders["gpt2"]), tmp_path / "out"
    done = fxshard("compile", model, "--tp", 2, "--weights", folders["gpt2"], "--out", out)
    assert done.returncode == 0, done.stderr
    run = fxshard("run", out, "--steps", 2, "--metrics", tmp_path / "m.jsonl")
    assert run.returncode == 0, run.stdout + run.stderr
    got = [json.loads(x)["loss"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    want = _pretrained_losses(model, folders["gpt2"])[:2]
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= REL * abs(w), (g, w)
    bad = fxshard("compile", ROOT / "samples" / "llama.py", "--tp", 2, "--weights", folders["gpt2"],
                  "--out", tmp_path / "bad")
    assert bad.returncode == 2 and "a checkpoint of a different model" in bad.stderr
