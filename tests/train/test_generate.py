"""``fxshard generate`` (``fxshard/train/generate.py``): from a checkpoint of a tiny Qwen2 folder compiled at tp=2 and
trained 3 steps on a packed token file, greedy decoding gives token for token what transformers' ``generate`` gives on
the model trained on one device from the same folder, as text and as one chat turn; sampling is seeded; and the
refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_in_process import fxshard

from fxshard.capture.modelfile import load_model_file
from fxshard.check.verify import with_weights
from fxshard.driver import compile as compile_model
from fxshard.driver import model_source
from fxshard.errors import OptionError
from fxshard.ir.layout import Layout
from fxshard.testing import cli
from fxshard.train.data import DataOptions
from fxshard.train.generate import GenerateError, Sampling, generate
from fxshard.train.reference import reference_losses

STEPS = 3
CHAT = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}" \
       "{% if add_generation_prompt %}<assistant> {% endif %}"


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A Qwen2 folder with the corpus' tokenizer (and a chat template), compiled at tp=2, trained 3 steps on the
    corpus' token file packed, with a checkpoint; and the same 3 steps on one device from the folder's weights:
    ``(root, folder, trained state)``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokens, _ = corpus
    root = tmp_path_factory.mktemp("generate")
    folder = root / "qwen2"
    torch.manual_seed(3)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                 tie_word_embeddings=True, eos_token_id=0)).save_pretrained(folder)
    for f in (tokens / "tok").iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT}))
    data = DataOptions(data=tokens / "t.bin", pack=True)  # the folder's model file takes --pack as it is
    with model_source(folder, seq=16, batch=4) as source:
        compile_model(source.model_file, Layout(tp=2), out=root / "out", weights=source.weights)
        state: dict = {}
        reference_losses(with_weights(load_model_file(source.model_file), folder), STEPS, final_state=state,
                         data=data)
    done = cli("run", root / "out", "--steps", STEPS, "--data", data.data, "--pack", "--checkpoint", root / "ckpt",
               "--save-every", STEPS)
    assert done.returncode == 0, done.stdout + done.stderr
    return root, folder, state


def _one_device(folder, state, ids: list[int], **sampling):
    """transformers' generate on the model trained on one device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.load_state_dict(state)
    model.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), eos_token_id=0, pad_token_id=0, **sampling)
    return out[0, len(ids):].tolist()


@pytest.mark.e2e
def test_greedy_decoding_equals_transformers_generate_on_the_one_device_model(trained):
    from transformers import AutoTokenizer

    root, folder, state = trained
    tok = AutoTokenizer.from_pretrained(folder)
    done = generate(root / "ckpt", "the", sampling=Sampling(max_new_tokens=12))
    assert done.prompt_ids == tok("the")["input_ids"] and done.tokenizer == folder  # the folder's, by TOKENIZER
    want = _one_device(folder, state, done.prompt_ids, max_new_tokens=12, do_sample=False)
    assert done.new_ids == want and len(want) > 0
    assert done.text == tok.decode(want, skip_special_tokens=True)
    printed = fxshard("generate", root / "ckpt", "--prompt", "the", "--max-new-tokens", 12)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == done.text.strip()


@pytest.mark.e2e
def test_chat_renders_the_tokenizers_template_and_decodes_the_answer(trained):
    from transformers import AutoTokenizer

    root, folder, state = trained
    tok = AutoTokenizer.from_pretrained(folder)
    done = generate(root / "ckpt", "hello", chat=True, sampling=Sampling(max_new_tokens=8))
    assert done.prompt_ids == tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)
    assert done.new_ids == _one_device(folder, state, done.prompt_ids, max_new_tokens=8, do_sample=False)


@pytest.mark.e2e
def test_sampling_is_seeded(trained):
    root, folder, state = trained
    one = generate(root / "ckpt", "the", sampling=Sampling(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1))
    assert one == generate(root / "ckpt", "the", sampling=Sampling(max_new_tokens=16, temperature=1.0, top_p=0.9,
                                                                   seed=1))
    other = generate(root / "ckpt", "the", sampling=Sampling(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=2))
    assert other.new_ids != one.new_ids
    torch.manual_seed(1)
    assert one.new_ids == _one_device(folder, state, one.prompt_ids, max_new_tokens=16, do_sample=True,
                                      temperature=1.0, top_p=0.9, top_k=0)


@pytest.mark.e2e
def test_refused_without_a_tokenizer_a_chat_template_or_the_models_vocabulary(trained, corpus, tmp_path):
    from fxshard.train.data.synthetic import train_tokenizer

    root, folder, _ = trained
    with pytest.raises(GenerateError, match=r"the tokenizer has no chat template .* drop --chat"):
        generate(root / "ckpt", "hello", chat=True, tokenizer=corpus[0] / "tok")  # the corpus' own: no template
    model = tmp_path / "model.py"
    model.write_text((root / "ckpt" / f"step-{STEPS:08d}" / "model.py").read_text().replace("TOKENIZER = FOLDER",
                                                                                  "TOKENIZER = None"))
    with pytest.raises(GenerateError, match=r"names no tokenizer .* give one with --tokenizer DIR"):
        generate(root / "ckpt", "the", model_file=model)
    wide = train_tokenizer(corpus[0] / "corpus", tmp_path / "wide", vocab=1024)
    text = (corpus[0] / "corpus").glob("*.jsonl").__next__().read_text().splitlines()[0]
    with pytest.raises(GenerateError, match=r"beyond the model's vocabulary of 256: a tokenizer of another model"):
        generate(root / "ckpt", json.loads(text)["text"], tokenizer=wide)
    done = fxshard("generate", root / "ckpt", "--prompt", "x", "--tokenizer", tmp_path / "none")
    assert done.returncode == 2 and "no such folder (--tokenizer)" in done.stderr


def test_sampling_options_and_an_empty_prompt_are_refused_before_the_model_is_built(tmp_path):
    for sampling, match in ((Sampling(max_new_tokens=0), "--max-new-tokens 0"),
                            (Sampling(temperature=-1.0), "--temperature -1.0"),
                            (Sampling(temperature=0.7, top_p=1.5), r"--top-p 1.5: expected a probability"),
                            (Sampling(top_p=0.9), r"--top-p 0.9: samples, but --temperature is 0")):
        with pytest.raises(OptionError, match=match):
            generate(tmp_path / "no-checkpoint", "the", sampling=sampling)
    with pytest.raises(OptionError, match="--prompt is empty"):
        generate(tmp_path / "no-checkpoint", "")
    done = fxshard("generate", tmp_path / "no-checkpoint", "--prompt", "x", "--temperature", "nan")
    assert done.returncode == 2 and "--temperature nan" in done.stderr


def test_generate_and_data_generate_say_which_is_which():
    top = fxshard("--help").stdout
    assert "Decode text from a trained checkpoint" in top
    data = fxshard("data", "--help").stdout
    assert "fxshard generate" in data and "not `data generate`" in " ".join(data.split())
