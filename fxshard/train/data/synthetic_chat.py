"""A generated chat dataset and a tokenizer folder whose config carries a chat template: ``fxshard data
generate OUT --chat``, to try ``data tokenize --format chat`` and a fine-tune with no download.

Each conversation has one to three exchanges, sometimes after a system message: the user asks for a phrase of
made-up words backwards, the assistant answers with the words in reverse order (something a model can learn,
and that shows in ``fxshard generate``).  The tokenizer is a byte-level BPE (as Qwen2's and Llama 3's: every
text encodes, and decodes back) trained on the rendered conversations, with ChatML's
``<|im_start|>``/``<|im_end|>`` and Qwen2's chat template, which has no ``{% generation %}`` markers (so the
prefix method masks it)::

    write_chat_corpus(Path("chat"), conversations=1000)   # chat/part-000.jsonl: {"messages": [...]} per line
    train_chat_tokenizer(Path("chat"), Path("tok"), vocab=512)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fxshard.train.data.synthetic import _lexicon

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYSTEM = "You are a helpful assistant."
# Qwen2's ChatML template: a default system message, each message between <|im_start|>ROLE and <|im_end|>
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def conversations(count: int, seed: int = 0, words: tuple[int, int] = (2, 8)) -> list[list[dict]]:
    """``count`` conversations of 1 to 3 exchanges, each phrase ``words`` (at least, at most) words long."""
    rng = np.random.default_rng(seed)
    lexicon = _lexicon(np.random.default_rng(1234), 300)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 4))):
            phrase = [lexicon[i] for i in rng.integers(0, len(lexicon), size=int(rng.integers(*words) + 1))]
            ask = "Say backwards" if rng.random() < 0.5 else "Reverse"
            messages += [{"role": "user", "content": f"{ask}: {' '.join(phrase)}"},
                         {"role": "assistant", "content": " ".join(reversed(phrase)) + "."}]
        out.append(messages)
    return out


def write_chat_corpus(folder: Path, count: int, seed: int = 0) -> Path:
    """``folder/part-000.jsonl``: ``count`` conversations, one ``{"messages": [...]}`` per line."""
    from fxshard.train.data.synthetic import save_corpus

    return save_corpus(folder, 1, lambda k: "".join(json.dumps({"messages": m}) + "\n"
                                                     for m in conversations(count, seed)))[0]


def train_chat_tokenizer(corpus: Path, out: Path, vocab: int = 512) -> Path:
    """A byte-level BPE of ``vocab`` ids trained on ``corpus``'s conversations (ChatML rendered), saved as a
    Hugging Face tokenizer folder whose ``tokenizer_config.json`` holds the chat template, EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fxshard.errors import DataError
    from fxshard.train.data.rows import corpus_rows
    from fxshard.train.data.synthetic import save_tokenizer

    if vocab < 256 + len(SPECIALS) + 1:
        raise DataError(f"--vocab {vocab}: a byte-level tokenizer holds the 256 bytes and {len(SPECIALS)} "
                        "special tokens; give --vocab 300 or more (512 by default)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (f"{m['role']}\n{m['content']}" for _, r in corpus_rows(corpus) for m in r["messages"])
    tokenizer.train_from_iterator(texts, trainer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 32768,
              "chat_template": CHAT_TEMPLATE}
    return save_tokenizer(out, tokenizer.to_str(), config)

