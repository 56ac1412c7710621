"""Chat data: a conversation is rendered with the tokenizer folder's own chat template and masked exactly as
transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` masks it where the template has
``{% generation %}`` markers; a Qwen2- or Llama-3-style template without markers (the prefix method) gives the
mask transformers gives the same template with markers added; prompt-completion rows train on the completion;
every bad row is refused by its place (``file:line``, ``row N``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from fxshard.errors import DataError
from fxshard.train.data.chat import MARKERS, PREFIXES, ChatRenderer, PromptCompletion, load_hf_tokenizer
from fxshard.train.data.chat_tokenize import tokenize_chat
from fxshard.train.data.loss_mask import LossMask
from fxshard.train.data.rows import corpus_rows
from fxshard.train.data.synthetic_chat import CHAT_TEMPLATE, conversations
from fxshard.train.data.tokens import TokenFile

CHATML = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}{%- if m['role'] == 'assistant' "
          "-%}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{%- else -%}{{ "
          "m['content'] + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ "
          "'<|im_start|>assistant\\n' }}{%- endif -%}")
# Llama 3's structure: BOS once, a header per message, <|eot_id|> after each; and the same with markers
LLAMA3 = ("{{- bos_token -}}{%- for m in messages -%}{{- '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' -}}{%- endfor -%}{%- if "
          "add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif "
          "-%}")
LLAMA3_MARKED = LLAMA3.replace(
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + "
    "'<|eot_id|>' -}}",
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' -}}{%- if m['role'] == 'assistant' -%}"
    "{%- generation -%}{{- m['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}{%- else -%}"
    "{{- m['content'] | trim + '<|eot_id|>' -}}{%- endif -%}")
QWEN2_MARKED = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{%- if message['role'] == 'assistant' -%}{% generation %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}{%- else -%}"
    "{{ message['content'] + '<|im_end|>\\n' }}{%- endif -%}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]


def _tokenizer_folder(folder: Path, template: str | None, eos: str = "<|im_end|>",
                      bos: str | None = None) -> Path:
    """A byte-level BPE built here with ``tokenizers`` (trained on the generated conversations), saved as a
    Hugging Face folder whose tokenizer_config.json carries ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in conversations(200, seed=5) for m in c]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


CHATS = conversations(40, seed=11)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: _tokenizer_folder(root / name, template, *extra) for name, template, *extra in [
        ("chatml-marked", CHATML), ("qwen2", CHAT_TEMPLATE), ("qwen2-marked", QWEN2_MARKED),
        ("llama3", LLAMA3, "<|eot_id|>", "<|begin_of_text|>"),
        ("llama3-marked", LLAMA3_MARKED, "<|eot_id|>", "<|begin_of_text|>"), ("none", None)]}


@functools.cache
def _hf(folder: Path):
    return load_hf_tokenizer(folder)


def _transformers(folder: Path, chat: list) -> tuple[list, list]:
    out = _hf(folder).apply_chat_template(chat, tokenize=True, return_dict=True,
                                                        return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


def test_a_marked_template_masks_as_transformers_does(folders):
    renderer = ChatRenderer.load(folders["chatml-marked"])
    assert renderer.method == MARKERS
    rows = renderer.render_many([(f"row {i}", c) for i, c in enumerate(CHATS)])
    tok = renderer.tokenizer
    for chat, row in zip(CHATS, rows, strict=True):
        ids, mask = _transformers(folders["chatml-marked"], chat)
        assert row.ids.tolist() == ids and row.mask.tolist() == mask
        # and what it trains is the assistant's replies with their end of turn, nothing else
        want = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
        assert tok.decode(row.ids[row.mask == 1]) == want


@pytest.mark.parametrize("plain, marked", [("qwen2", "qwen2-marked"), ("llama3", "llama3-marked")])
def test_a_template_without_markers_masks_as_its_marked_twin(folders, plain, marked):
    """The prefix method on Qwen2's (a default system message) and Llama 3's (BOS, headers) templates gives
    the ids transformers renders and the mask transformers gives the same template with {% generation %}
    added."""
    renderer = ChatRenderer.load(folders[plain])
    assert renderer.method == PREFIXES
    tok = _hf(folders[plain])
    for i, chat in enumerate(CHATS):
        row = renderer.render(chat, f"row {i}")
        assert row.ids.tolist() == tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        ids, mask = _transformers(folders[marked], chat)
        assert row.ids.tolist() == ids and row.mask.tolist() == mask, f"row {i}"


@pytest.mark.parametrize("folder", ["chatml-marked", "qwen2"])
def test_train_on_last_assistant_or_all(folders, folder):
    chat = next(c for c in CHATS if sum(m["role"] == "assistant" for m in c) >= 2)
    every = ChatRenderer.load(folders[folder]).render(chat, "r")
    last = ChatRenderer.load(folders[folder], train_on="last-assistant").render(chat, "r")
    tok = load_hf_tokenizer(folders[folder])
    assert tok.decode(last.ids[last.mask == 1]) == chat[-1]["content"] + "<|im_end|>\n"
    assert last.mask.sum() < every.mask.sum() and np.all(every.mask >= last.mask)
    assert ChatRenderer.load(folders[folder], train_on="all").render(chat, "r").mask.all()


def test_prompt_completion_trains_on_the_completion_and_eos(folders):
    pc = PromptCompletion(load_hf_tokenizer(folders["llama3"]))
    row = pc.render_many([("r", {"prompt": "Reverse: ka lo mi", "completion": " mi lo ka."})])[0]
    tok = pc.tokenizer
    assert row.ids[0] != tok.eos_token_id and row.ids[-1] == tok.eos_token_id and row.mask[-1] == 1
    assert tok.decode(row.ids[row.mask == 1]) == " mi lo ka.<|eot_id|>"
    assert tok.decode(row.ids[row.mask == 0]) == "Reverse: ka lo mi"


def _write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"messages": [{"role": "user", "content": "Reverse: ka lo"},
                     {"role": "assistant", "content": "lo ka."}]}


@pytest.mark.parametrize("row, says", [
    ({"text": "hello"}, "bad.jsonl:2: no 'messages' (fields ['text']); --format chat reads rows"),
    ({"messages": [{"role": "robot", "content": "x"}]},
     "bad.jsonl:2: message 0 has the unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "hi"}]},
     "bad.jsonl:2: nothing to train on (no assistant message"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "bad.jsonl:2: message 0 (user) has content ['a']"),
    ({"messages": []}, "bad.jsonl:2: 'messages' is an empty list"),
    ({"messages": [{"role": "assistant", "content": "x"}]},
     "bad.jsonl:2: the conversation starts with an assistant message"),
])
def test_bad_rows_are_refused_by_line(folders, tmp_path, row, says):
    corpus = _write_rows(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(DataError, match="^" + _re(f"{corpus.parent}/{says}")):
        tokenize_chat(corpus, folders["qwen2"], tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.mask").exists()


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix(folders, tmp_path):
    corpus = _write_rows(tmp_path / "c.jsonl", [GOOD])
    with pytest.raises(DataError, match="no chat template .* use --format prompt-completion"):
        tokenize_chat(corpus, folders["none"], tmp_path / "x.bin")
    rows = _write_rows(tmp_path / "pc.jsonl", [{"prompt": "Reverse: ka lo", "completion": " lo ka."},
                                               {"prompt": 1}])
    with pytest.raises(DataError, match=_re(f"{rows}:2: no string field 'prompt' (found 1)")):
        tokenize_chat(rows, folders["none"], tmp_path / "x.bin", fmt="prompt-completion")


def test_a_template_that_rewrites_earlier_turns_is_refused(folders, tmp_path):
    """Qwen3's template drops an earlier turn's reasoning once a later user message follows: the prefix method
    cannot tell the assistant's tokens and says to mark them."""
    rewrites = CHAT_TEMPLATE.replace("message['content']", "(message['content'] if loop.last or "
                                                           "message['role'] != "
                                     "'assistant' else message['content'][:3])")
    (tmp_path / "t.jinja").write_text(rewrites)
    corpus = _write_rows(tmp_path / "c.jsonl", [{"messages": GOOD["messages"] * 2}])
    with pytest.raises(DataError, match=_re(f"{corpus}:1: the chat template renders assistant message 1 "
                                            "differently once later messages follow")):
        tokenize_chat(corpus, folders["qwen2"], tmp_path / "x.bin", chat_template=tmp_path / "t.jinja")


def test_too_long_is_refused_truncated_or_dropped_and_counted(folders, tmp_path):
    corpus = _write_rows(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    full = tokenize_chat(corpus, folders["qwen2"], tmp_path / "full.bin")
    lengths = TokenFile.open(tmp_path / "full.bin").document_lengths()
    seq = int(np.median(lengths))
    over = int((lengths > seq).sum())
    first_over = int(np.argmax(lengths > seq)) + 1
    with pytest.raises(DataError, match=_re(f"{corpus}:{first_over}: the conversation is "
                                            f"{lengths[first_over - 1]} tokens, longer than --seq {seq}; "
                                            "pass --truncate right")):
        tokenize_chat(corpus, folders["qwen2"], tmp_path / "x.bin", seq=seq)
    dropped = tokenize_chat(corpus, folders["qwen2"], tmp_path / "drop.bin", seq=seq, truncate="drop")
    assert (dropped.conversations, dropped.dropped, dropped.truncated) == (len(CHATS) - over, over, 0)
    cut = tokenize_chat(corpus, folders["qwen2"], tmp_path / "cut.bin", seq=seq, truncate="right")
    assert cut.truncated + cut.dropped == over and cut.conversations == len(CHATS) - cut.dropped
    assert cut.longest == seq and full.longest == int(lengths.max())
    file, mask = TokenFile.open(tmp_path / "cut.bin"), LossMask.beside(TokenFile.open(tmp_path / "cut.bin"))
    assert int(mask.read(0, file.tokens).sum()) == cut.trained_tokens
    side = json.loads((tmp_path / "cut.json").read_text())
    assert side["chat"] == {"format": "chat", "train_on": "assistant", "masking": PREFIXES, "seq": seq,
                            "truncate": "right", "rows": len(CHATS), "truncated": cut.truncated,
                            "dropped": cut.dropped, "trained": cut.trained_tokens, "longest": seq}


def test_the_token_file_holds_each_conversation_and_its_mask(folders, tmp_path):
    corpus = _write_rows(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    done = tokenize_chat(corpus, folders["qwen2"], tmp_path / "c.bin", validation=0.1)
    file = TokenFile.open(tmp_path / "c.bin")
    mask = LossMask.beside(file)
    assert (file.documents, file.validation_documents, done.validation_documents) == (40, 4, 4)
    renderer = ChatRenderer.load(folders["qwen2"])
    for d in (0, 17, 39):
        start, n = int(file.starts[d]), int(file.document_lengths()[d])
        row = renderer.render(CHATS[d], "r")
        assert file.read(start, n).tolist() == row.ids.tolist()
        assert mask.read(start, n).tolist() == row.mask.tolist()


@pytest.mark.slow  # imports datasets (pandas, pyarrow): several seconds
def test_parquet_and_a_datasets_folder_read_as_the_jsonl(folders, tmp_path):
    datasets = pytest.importorskip("datasets")
    corpus = _write_rows(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    tokenize_chat(corpus, folders["qwen2"], tmp_path / "j.bin")
    data = datasets.Dataset.from_list([{"messages": c} for c in CHATS])
    data.to_parquet(str(tmp_path / "c.parquet"))
    datasets.DatasetDict({"train": data, "test": data.select(range(3))}).save_to_disk(str(tmp_path / "hf"))
    sources = ((tmp_path / "c.parquet", "p"), (tmp_path / "hf", "d"), (tmp_path / "hf" / "train", "t"))
    for source, name in sources:
        tokenize_chat(source, folders["qwen2"], tmp_path / f"{name}.bin")
        for suffix in (".bin", ".mask", ".idx"):
            got, want = (tmp_path / f"{name}{suffix}").read_bytes(), (tmp_path / f"j{suffix}").read_bytes()
            assert got == want, source
    places = [w for w, _ in corpus_rows(tmp_path / "hf")][:2]
    assert places == [f"{tmp_path}/hf/train row 0", f"{tmp_path}/hf/train row 1"]
    data.select(range(2)).map(lambda r: {"messages": [{"role": "robot", "content": "x"}]}).save_to_disk(
        str(tmp_path / "bad"))
    with pytest.raises(DataError, match=_re(f"{tmp_path}/bad row 0: message 0 has the unknown role 'robot'")):
        tokenize_chat(tmp_path / "bad", folders["qwen2"], tmp_path / "x.bin")
