"""A Hugging Face folder compiles as it is (``fxshard/capture/hf_folder.py``): the model file fxshard writes for it,
its example batch for every task, the refusals before anything is built, and a tiny Qwen2 folder (tied embeddings)
compiled at tp=2 training as one device trains ``from_pretrained`` of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_in_process import fxshard

from fxshard.capture.folder_options import FolderOptions
from fxshard.capture.hf_folder import TASKS
from fxshard.capture.modelfile import load_model_file
from fxshard.driver import model_source
from fxshard.errors import ModelFileError, OptionError

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=64)
BERT_SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, num_labels=3, pad_token_id=0)


def _save(name: str, to: Path) -> None:
    """Save folder ``name`` with save_pretrained (seed 3: not the weights make_model() would draw)."""
    import transformers as t

    torch.manual_seed(3)
    bert = {"bert-cls": t.BertForSequenceClassification, "bert-tokens": t.BertForTokenClassification,
            "bert-mlm": t.BertForMaskedLM, "bert-qa": t.BertForQuestionAnswering}
    if name == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**LLAMA_SHAPE, tie_word_embeddings=True, eos_token_id=2,
                                                 dtype="bfloat16"))
    elif name == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**LLAMA_SHAPE))
    elif name == "t5":
        model = t.T5ForConditionalGeneration(t.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                        num_heads=4, decoder_start_token_id=0))
    else:  # question answering: a start and an end logit
        model = bert[name](t.BertConfig(**BERT_SHAPE | ({"num_labels": 2} if name == "bert-qa" else {})))
    model.save_pretrained(to)


class _Folders:
    """``folders / NAME``: the folder saved on first use (each test builds only the models it reads)."""

    def __init__(self, root: Path):
        self.root = root

    def __truediv__(self, name: str) -> Path:
        if not (self.root / name).is_dir():
            _save(name, self.root / name)
        return self.root / name


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory.mktemp("hf"))


def _copy(folders: Path, name: str, tmp_path: Path) -> Path:
    to = tmp_path / name
    shutil.copytree(folders / name, to)
    return to


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# ---------------------------------------------------------------- the model file written for a folder


def test_the_model_file_builds_the_folders_model_in_fp32_with_a_right_padded_causal_batch(folders):
    with model_source(folders / "qwen2", seq=16, batch=4) as source:
        text = source.model_file.read_text()
        mf = load_model_file(source.model_file)
        model, inputs = mf.build_model(0), mf.build_inputs(0)
    assert source.weights == (folders / "qwen2").resolve()
    assert f'FOLDER = "{(folders / "qwen2").resolve()}"' in text and "BATCH, SEQ = 4, 16" in text
    assert "AutoModelForCausalLM.from_config(config, dtype=torch.float32)" in text
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the folder saved bf16
    assert sorted(inputs) == ["input_ids", "labels", "position_ids", "use_cache"]  # no attention_mask: --pack works
    ids, labels = inputs["input_ids"], inputs["labels"]
    assert ids.shape == labels.shape == inputs["position_ids"].shape == (4, 16)
    assert (ids[1::2, 8:] == 2).all() and (labels[1::2, 8:] == -100).all()  # padded with the eos id, not trained
    assert (labels[0::2] == ids[0::2]).all() and (labels[:, :8] == ids[:, :8]).all()
    assert torch.isfinite(model(**inputs).loss)
    with model_source(folders / "qwen2", seq=16, batch=4) as again:  # the same bytes: a recompile keeps the digest
        assert again.model_file.read_text() == text


@pytest.mark.parametrize("name,task,labels_shape", [
    ("bert-cls", "sequence-classification", (4,)), ("bert-tokens", "token-classification", (4, 16)),
    ("bert-mlm", "masked-lm", (4, 16)), ("bert-qa", "question-answering", None), ("t5", "seq2seq-lm", (4, 16))])
def test_every_task_gets_its_head_and_an_example_batch_the_model_takes(folders, name, task, labels_shape):
    with model_source(folders / name, seq=16, batch=4, weights=False) as source:
        assert source.folder.task is TASKS[task] and source.weights is None
        mf = load_model_file(source.model_file)
        model, inputs = mf.build_model(0), mf.build_inputs(0)
    assert (inputs["attention_mask"][1::2, 8:] == 0).all() and (inputs["attention_mask"][0] == 1).all()
    if labels_shape is not None:
        assert tuple(inputs["labels"].shape) == labels_shape
    if task == "sequence-classification":
        assert int(inputs["labels"].max()) < 3  # num_labels
    out = model(**inputs)
    assert out.loss is not None and torch.isfinite(out.loss)


def test_task_overrides_the_architecture_and_is_checked_against_the_model_type(folders):
    with model_source(folders / "llama", FolderOptions(task="sequence-classification"), seq=16, batch=2,
                      weights=False) as source:
        assert "AutoModelForSequenceClassification" in source.model_file.read_text()
    with pytest.raises(OptionError, match=r"--task seq2seq-lm: transformers has no AutoModelForSeq2SeqLM for "
                                          r"model_type 'llama'"), \
            model_source(folders / "llama", FolderOptions(task="seq2seq-lm"), seq=16, batch=2):
        pass
    with pytest.raises(OptionError, match=r"--task image-gen: not a task .* causal-lm\|seq2seq-lm"), \
            model_source(folders / "llama", FolderOptions(task="image-gen"), seq=16, batch=2):
        pass


def test_a_model_files_own_flags_and_a_folders_are_not_mixed(folders, tmp_path):
    model = ROOT / "samples" / "llama.py"
    with pytest.raises(OptionError, match=r"--task and --trust-remote-code: for a Hugging Face folder; .* drop"), \
            model_source(model, FolderOptions(task="causal-lm", trust_remote_code=True)):
        pass
    done = fxshard("compile", model, "--batch", 8, "--out", tmp_path / "o")
    assert done.returncode == 2 and "--batch 8: shapes the example batch of a Hugging Face folder" in done.stderr
    done = fxshard("compile", model, "--seq", 8, "--out", tmp_path / "o")
    assert done.returncode == 2 and "or add --auto" in done.stderr
    done = fxshard("compile", folders / "llama", "--seq", 8, "--batch", 2, "--weights", folders / "llama",
                   "--out", tmp_path / "o")
    assert done.returncode == 2 and "read as its own weights; drop --weights" in done.stderr


# ---------------------------------------------------------------- refused before anything is built


def test_refused_without_config_json_naming_what_the_folder_holds(folders, tmp_path):
    folder = _copy(folders, "llama", tmp_path)
    (folder / "config.json").unlink()
    done = fxshard("compile", folder, "--seq", 16, "--batch", 2, "--out", tmp_path / "o")
    assert done.returncode == 2, done.stderr
    assert "no config.json (found generation_config.json, model.safetensors)" in done.stderr
    assert "Give that folder, or a model file" in done.stderr and not (tmp_path / "o").exists()


def test_refused_for_a_model_type_or_architecture_transformers_lacks(folders, tmp_path):
    folder = _copy(folders, "llama", tmp_path)
    _edit_config(folder, model_type="llama-next")
    with pytest.raises(ModelFileError, match=r"model_type 'llama-next' is not a model transformers .* upgrade"), \
            model_source(folder, seq=16, batch=2):
        pass
    _edit_config(folder, model_type="llama", architectures=["LlamaNextForCausalLM"])
    with pytest.raises(ModelFileError, match=r"architecture LlamaNextForCausalLM is not a class transformers"), \
            model_source(folder, seq=16, batch=2):
        pass


def test_refused_without_a_head_to_build_or_an_example_size(folders, tmp_path):
    folder = _copy(folders, "llama", tmp_path)
    _edit_config(folder, architectures=None)
    with pytest.raises(OptionError, match=r"names no architectures, not a head .* give --task causal-lm\|"):
        with model_source(folder, seq=16, batch=2):
            pass
    with model_source(folder, FolderOptions(task="causal-lm"), seq=16, batch=2) as source:
        assert source.folder.task.name == "causal-lm"
    with pytest.raises(OptionError, match=r"found no --batch. Give both, e.g. --seq 2048 --batch 8"):
        with model_source(folder, seq=16):
            pass
    with pytest.raises(OptionError, match=r"--seq 65: longer than the 64 positions .* give --seq 64 or less"):
        with model_source(folder, FolderOptions(task="causal-lm"), seq=65, batch=2):
            pass


def test_refused_without_safetensors_before_capture_but_planned_from_config_alone(folders, tmp_path):
    folder = _copy(folders, "llama", tmp_path)
    (folder / "model.safetensors").unlink()
    done = fxshard("compile", folder, "--seq", 16, "--batch", 2, "--out", tmp_path / "o")
    assert done.returncode == 2 and "holds neither model.safetensors nor" in done.stderr
    with model_source(folder, seq=16, batch=2, weights=False) as source:  # plan, compile --meta: shapes only
        assert source.weights is None


REMOTE_CONFIG = '''from transformers import LlamaConfig


class TinyConfig(LlamaConfig):
    model_type = "tiny-remote"
'''
REMOTE_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_tiny import TinyConfig


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig
'''


def test_code_in_the_folder_runs_only_with_trust_remote_code(folders, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not the user's cache
    folder = _copy(folders, "llama", tmp_path)
    (folder / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny.py").write_text(REMOTE_MODEL)
    _edit_config(folder, model_type="tiny-remote", architectures=["TinyForCausalLM"],
                 auto_map={"AutoConfig": "configuration_tiny.TinyConfig",
                           "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    with pytest.raises(ModelFileError) as refused, model_source(folder, seq=16, batch=2):
        pass
    message = str(refused.value)
    assert "AutoModelForCausalLM -> modeling_tiny.TinyForCausalLM" in message
    assert "on every rank of every run" in message and "add --trust-remote-code" in message
    assert not (tmp_path / "modules").exists()  # nothing of the folder's code was imported
    with model_source(folder, FolderOptions(trust_remote_code=True), seq=16, batch=2) as source:
        text = source.model_file.read_text()
        model = load_model_file(source.model_file).build_model(0)
    assert "from_config(config, dtype=torch.float32, trust_remote_code=True)" in text
    assert type(model).__name__ == "TinyForCausalLM" and source.folder.task.name == "causal-lm"
    assert source.argv()[-1] == "--trust-remote-code"


@pytest.mark.slow
def test_a_folder_whose_tensors_do_not_fit_its_config_is_refused_naming_the_tensor(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(folders, "llama", tmp_path)
    _edit_config(folder, intermediate_size=96)
    done = fxshard("compile", folder, "--tp", 2, "--seq", 16, "--batch", 2, "--out", tmp_path / "o")
    assert done.returncode == 2, done.stderr
    assert "model.layers.0.mlp.gate_proj.weight has shape [128, 64], the model (its config) expects [96, 64]" \
        in done.stderr and not (tmp_path / "o").exists()
    _edit_config(folder, intermediate_size=128)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    done = fxshard("compile", folder, "--tp", 2, "--seq", 16, "--batch", 2, "--out", tmp_path / "o")
    assert done.returncode == 2 and "tensor model.layers.1.self_attn.o_proj.weight is missing" in done.stderr


# ---------------------------------------------------------------- compiled, recompiled, planned, trained


@pytest.mark.slow
def test_the_compiled_folder_recompiles_on_its_own_to_the_same_rank_files(folders, tmp_path):
    out, again = tmp_path / "out", tmp_path / "again"
    done = fxshard("compile", folders / "qwen2", "--tp", 2, "--seq", 16, "--batch", 4, "--out", out)
    assert done.returncode == 0, done.stderr
    assert "the model file written for" in done.stdout and "Qwen2ForCausalLM, causal-lm" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weights"]["dir"] == str((folders / "qwen2").resolve())
    params = [t for e in manifest["ranks"] for t in e["tensors"].values() if t["kind"] == "parameter"]
    assert params and all(t["checkpoint"]["file"].startswith(manifest["weights"]["dir"]) for t in params)
    done = fxshard("compile", out / "model.py", "--tp", 2, "--weights", folders / "qwen2", "--out", again)
    assert done.returncode == 0, done.stderr
    for name in ("rank_pp0_tp0.py", "rank_pp0_tp1.py", "model.py"):
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


@pytest.mark.slow
def test_the_python_api_compiles_a_folder_as_the_command_line_does(folders, tmp_path):
    import fxshard as fx

    done = fxshard("compile", folders / "qwen2", "--tp", 2, "--seq", 16, "--batch", 4, "--out", tmp_path / "cli")
    assert done.returncode == 0, done.stderr
    result = fx.compile(folders / "qwen2", tmp_path / "api", tp=2, seq=16, batch=4)
    assert result.files == ["rank_pp0_tp0.py", "rank_pp0_tp1.py"]
    for name in ("rank_pp0_tp0.py", "rank_pp0_tp1.py", "model.py"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "api" / name).read_bytes(), name
    with pytest.raises(OptionError, match="--weights .* is a Hugging Face folder"):
        fx.compile(folders / "qwen2", tmp_path / "w", tp=2, seq=16, batch=4, weights=folders / "qwen2")


@pytest.mark.slow
def test_plan_takes_the_folder(folders):
    done = fxshard("plan", folders / "qwen2", "--tp", 2, "--seq", 32, "--batch", 8, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["at"] == {"B": 8, "S": 32}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_qwen2_folder_at_tp2_trains_as_one_device_trains_from_pretrained(folders, tmp_path):
    from fxshard.driver import verify
    from fxshard.ir.layout import Layout

    with model_source(folders / "qwen2", seq=16, batch=4) as source:
        result = verify(source.model_file, Layout(tp=2), steps=3, weights=source.weights, out=tmp_path / "v")
    assert result.ok, result.summary()
    assert result.loss_rel <= 1e-5 and result.param_rel <= 1e-3
    # the single-device side started from the folder's weights, not make_model()'s: its first loss is theirs
    from transformers import AutoModelForCausalLM

    with model_source(folders / "qwen2", seq=16, batch=4) as source:
        inputs = load_model_file(source.model_file).build_inputs(0)
    loaded = AutoModelForCausalLM.from_pretrained(folders / "qwen2", dtype=torch.float32)
    assert abs(loaded(**inputs).loss.item() - result.distributed[0]) <= 1e-5 * result.distributed[0]


@pytest.mark.slow
def test_plan_auto_takes_the_folder_and_prints_the_command_that_compiles_it(folders):
    done = fxshard("plan", folders / "qwen2", "--seq", 16, "--batch", 4, "--auto", "--gpus", 2, "--hardware",
                   "cpu-gloo", "--top", 2)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert f"fxshard plan --auto: {folders / 'qwen2'}" in text  # the folder, not the file written for it
    assert f"compile it: fxshard compile {folders / 'qwen2'} --seq 16 --batch 4 --task causal-lm" in text


@pytest.mark.slow
def test_compile_meta_takes_a_folder_without_its_weights(folders, tmp_path):
    folder = _copy(folders, "llama", tmp_path)
    (folder / "model.safetensors").unlink()
    done = fxshard("compile", folder, "--tp", 2, "--seq", 16, "--batch", 2, "--meta", "--out", tmp_path / "o")
    assert done.returncode == 0, done.stderr
    assert "compiled --meta: no weights" in " ".join(done.stdout.split())
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["weights"]["dir"] is None
