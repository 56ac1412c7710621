"""Issue 32 items 5 and 13: `fxshard export --hf DIR` treats DIR as compile treats --out (a folder not an
export's is refused, the checkpoint's own folders are refused, an earlier export is replaced by a swap that keeps
the user's files), and a Hugging Face index whose weight_map leads out of its folder is refused.

The checkpoint is written in fxshard's own format (index.json, a shard of full tensors, the model file's copy)
from the model's initial weights, without a training run: what these tests exercise is the export's folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fxshard.capture.modelfile import load_model_file
from fxshard.errors import OutputFolderError, WeightsError
from fxshard.testing import cli
from fxshard.train.checkpoint import FORMAT, INDEX, LATEST
from fxshard.train.export import EXPORT_RECORD, export_hf

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "tests" / "models" / "mlp.py"
LLAMA = ROOT / "samples" / "llama.py"


def _checkpoint(folder: Path, model_file: Path = MLP) -> Path:
    """``folder/step-00000001`` holding the model's initial parameters whole, and ``folder/latest``."""
    model = load_model_file(model_file).build_model(0)
    step = folder / "step-00000001"
    step.mkdir(parents=True)
    whole = {"dim": 0, "index": 0, "parts": 1, "blocks": 1}
    tensors, records = {}, {}
    for name, p in model.named_parameters():
        tensors[f"{name}|param|0.0.1.1"] = p.detach().contiguous()
        records[name] = {"global_shape": list(p.shape), "dtype": "float32", "aliases": [],
                         "pieces": [{"slice": whole, "file": "shard-pp0-tp0.safetensors"}]}
    save_file(tensors, str(step / "shard-pp0-tp0.safetensors"))
    shutil.copyfile(model_file, step / "model.py")
    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()[:16]
    (step / INDEX).write_text(json.dumps({"format": FORMAT, "step": 1, "model_file": "model.py",
                                          "model_name": model_file.name, "model_digest": digest, "seed": 0,
                                          "tensors": records}))
    (folder / LATEST).write_text(step.name + "\n")
    return step


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".fxshard-" in p.name)


# ---------------------------------------------------------------- item 5


@pytest.mark.slow
def test_export_into_a_folder_that_is_not_an_exports_is_refused_and_left_alone(tmp_path):
    ckpt = tmp_path / "ckpt"
    _checkpoint(ckpt)
    theirs = tmp_path / "hf"
    theirs.mkdir()
    (theirs / "model.safetensors").write_text("someone's pretrained weights")
    (theirs / "config.json").write_text("{}")
    proc = cli("export", ckpt, "--hf", theirs, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "is not an fxshard export folder (no fxshard-export.json)" in proc.stderr, \
        proc.stderr
    assert "Traceback" not in proc.stderr
    assert (theirs / "model.safetensors").read_text() == "someone's pretrained weights"
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("where", ["step", "root", "inside the step"])
def test_export_into_the_checkpoints_own_folders_is_refused(tmp_path, where):
    ckpt = tmp_path / "ckpt"
    step = _checkpoint(ckpt)
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    target = {"step": step, "root": ckpt, "inside the step": step / "hf"}[where]
    with pytest.raises(OutputFolderError, match=r"--hf .*: is the checkpoint.*export into a folder of its own"):
        export_hf(ckpt if where != "step" else step, target)
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before


def test_export_again_replaces_its_own_files_and_keeps_the_users(tmp_path):
    ckpt = tmp_path / "ckpt"
    _checkpoint(ckpt)
    hf = tmp_path / "hf"
    export_hf(ckpt, hf)
    listed = json.loads((hf / EXPORT_RECORD).read_text())["files"]
    assert "model.safetensors" in listed and EXPORT_RECORD not in listed
    (hf / "tokenizer.json").write_text("the user's tokenizer")
    (hf / "model.safetensors").write_bytes(b"stale")  # the export's own file: replaced
    export_hf(ckpt, hf)
    assert (hf / "tokenizer.json").read_text() == "the user's tokenizer"
    from safetensors.torch import load_file

    exported = load_file(str(hf / "model.safetensors"))
    model = load_model_file(MLP).build_model(0)
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert _hidden(tmp_path) == []
    (hf / "config.json").write_text("a file the export would write, which its record does not list")
    record = json.loads((hf / EXPORT_RECORD).read_text())
    record["files"] = [f for f in record["files"] if f != "model.safetensors"]
    (hf / EXPORT_RECORD).write_text(json.dumps(record))
    with pytest.raises(OutputFolderError, match=r"model\.safetensors would be overwritten"):
        export_hf(ckpt, hf)  # the stage's own files are compared with the folder's before the swap
    assert _hidden(tmp_path) == [] and (hf / "tokenizer.json").exists()


# ---------------------------------------------------------------- item 13


@pytest.mark.slow
def test_a_weights_index_leading_out_of_its_folder_is_refused(tmp_path):
    from transformers import LlamaForCausalLM

    llama = load_model_file(LLAMA).module
    folder = tmp_path / "llama"
    LlamaForCausalLM(llama.config()).save_pretrained(folder)
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "elsewhere.safetensors"), "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "../elsewhere.safetensors" for n in names}}))
    proc = cli("compile", LLAMA, "--weights", folder, "--out", tmp_path / "o", cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "weight_map names '../elsewhere.safetensors'" in proc.stderr, proc.stderr
    assert "not a file inside" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
    from fxshard.codegen.weights import tensor_files

    for bad in ("/etc/hostname", "sub/../../elsewhere.safetensors", ""):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {names[0]: bad}}))
        with pytest.raises(WeightsError, match="not a file inside"):
            tensor_files(folder)
