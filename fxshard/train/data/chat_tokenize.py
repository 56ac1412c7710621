"""``fxshard data tokenize CORPUS --format chat|prompt-completion``: conversations to a token file with a loss
mask.

Each row (:mod:`~fxshard.train.data.rows`) is rendered and masked once (:mod:`~fxshard.train.data.chat`); the
ids go to ``PATH`` (uint16 up to 65,536 ids, else int32), the mask to ``PATH.mask`` (uint8, aligned with the
ids: :mod:`~fxshard.train.data.loss_mask`), one conversation per document of Megatron's ``.idx``, and the
``.json`` sidecar records both, with what was truncated or dropped.  ``seq`` bounds a conversation's tokens,
as ``truncate`` says: ``refuse`` (the default: the row is named), ``right`` (its first ``seq`` tokens; one
left with nothing to train on is dropped, counted) or ``drop`` (left out, counted).  A row is refused, by its
place (``file:line`` or ``row N``), when it has no ``messages`` (or ``prompt``/``completion``), an unknown
role, or nothing to train on::

    done = tokenize_chat(Path("chats.jsonl"), Path("tok"), Path("data/chat.bin"), seq=2048, truncate="right")
    done.conversations, done.trained_tokens, done.truncated
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fxshard.errors import DataError
from fxshard.files import FileSet
from fxshard.train.data.chat import TRAIN_ON, ChatRenderer, PromptCompletion, Rendered, load_hf_tokenizer
from fxshard.train.data.loss_mask import MASK_VERSION
from fxshard.train.data.rows import corpus_rows
from fxshard.train.data.tokens import megatron_index_bytes

FORMATS = ("chat", "prompt-completion")
TRUNCATE = ("refuse", "right", "drop")
CHUNK = 256  # rows rendered, then tokenized together


@dataclass(frozen=True)
class ChatTokenized:
    path: Path
    tokens: int
    conversations: int
    validation_documents: int
    trained_tokens: int
    truncated: int
    dropped: int
    longest: int
    dtype: str
    vocab_size: int
    method: str  # how the mask was made: "generation markers", "prefix renderings" or "completion"


def fitted(row: Rendered, seq: int | None, truncate: str, where: str) -> tuple[Rendered | None, str]:
    """``row`` within ``seq`` tokens as ``truncate`` says: (the row or None if dropped, "", "truncated" or
    "dropped")."""
    if seq is None or len(row.ids) <= seq:
        return row, ""
    if truncate == "refuse":
        raise DataError(f"{where}: the conversation is {len(row.ids)} tokens, longer than --seq {seq}; pass "
                        "--truncate right (keep its first tokens) or --truncate drop (leave it out), or a "
                        "larger --seq")
    if truncate == "drop":
        return None, "dropped"
    cut = Rendered(row.ids[:seq], row.mask[:seq])
    return (cut, "truncated") if cut.trained() else (None, "dropped")


def _renderer(fmt: str, tokenizer_dir: Path, train_on: str, chat_template: Path | None):
    if fmt not in FORMATS:
        raise DataError(f"--format {fmt}: expected text, {' or '.join(FORMATS)}")
    if train_on not in TRAIN_ON:
        raise DataError(f"--train-on {train_on}: expected one of {', '.join(TRAIN_ON)}")
    if fmt == "chat":
        return ChatRenderer.load(tokenizer_dir, train_on, chat_template)
    if chat_template is not None:
        raise DataError("--chat-template goes with --format chat; prompt-completion rows are plain text")
    return PromptCompletion(load_hf_tokenizer(tokenizer_dir), train_on, str(tokenizer_dir))


def _rendered(renderer, fmt: str, rows: list[tuple[str, dict]]) -> list[Rendered]:
    """Each row rendered and masked; a row without what its format reads, or with nothing to train on,
    refused."""
    if fmt == "chat":
        for where, record in rows:
            if "messages" not in record:
                raise DataError(f"{where}: no 'messages' (fields {sorted(record)[:8]}); --format chat reads "
                                'rows {"messages": [{"role": ..., "content": ...}, ...]} (rows of prompt and '
                                "completion: --format prompt-completion)")
        rows = [(where, record["messages"]) for where, record in rows]
    done = renderer.render_many(rows)
    for (where, _), row in zip(rows, done, strict=True):
        if not row.trained():
            what = "no assistant message" if fmt == "chat" else "an empty completion"
            raise DataError(f"{where}: nothing to train on ({what}: every target's loss mask is 0); remove "
                            "the row, or train on every token with --train-on all")
    return done


def _chunks(rows, size: int = CHUNK):
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenize_chat(corpus: Path, tokenizer_dir: Path, out: Path, *, fmt: str = "chat",
                  train_on: str = "assistant", seq: int | None = None, truncate: str = "refuse",
                  validation: float = 0.0, chat_template: Path | None = None,
                  progress: Callable[[int], None] | None = None) -> ChatTokenized:
    """Render, mask and tokenize ``corpus`` into ``out`` and its ``.mask``, ``.idx`` and ``.json`` (see the
    module docstring).  ``progress(rows)`` gets the rows read so far."""
    if truncate not in TRUNCATE:
        raise DataError(f"--truncate {truncate}: expected one of {', '.join(TRUNCATE)}")
    if seq is not None and seq < 2:
        raise DataError(f"--seq {seq}: expected the compiled sequence length (2 or more tokens)")
    out = Path(out)
    if out.suffix != ".bin":
        raise DataError(f"--out {out}: name the token file PATH.bin (its .mask, .idx and .json go beside it)")
    if not out.parent.is_dir():
        raise DataError(f"--out {out}: the folder {out.parent} does not exist; create it first")
    renderer = _renderer(fmt, tokenizer_dir, train_on, chat_template)
    vocab = len(renderer.tokenizer)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)
    from fxshard.train.data.tokenize import token_file_members

    members = token_file_members(out)
    binary, mask_file, idx, sidecar = members
    lengths: list[int] = []
    counts = {"truncated": 0, "dropped": 0, "trained": 0, "rows": 0}
    with FileSet(members) as staged:  # every member refused now (a link, a folder, not fxshard's), before the work
        with staged.open(binary) as ids_sink, staged.open(mask_file) as mask_sink:
            for chunk in _chunks(corpus_rows(corpus)):
                for (where, _), row in zip(chunk, _rendered(renderer, fmt, chunk), strict=True):
                    row, what = fitted(row, seq, truncate, where)
                    if what:
                        counts[what] += 1
                    if row is not None:
                        ids_sink.write(row.ids.astype(dtype).tobytes())
                        mask_sink.write(row.mask.tobytes())
                        lengths.append(len(row.ids))
                        counts["trained"] += row.trained()
                counts["rows"] += len(chunk)
                if progress is not None:
                    progress(counts["rows"])
        if not lengths:
            raise DataError(f"{corpus}: no conversation to write ({counts['rows']} rows read, "
                            f"{counts['dropped']} dropped by --truncate {truncate})")
        held = min(len(lengths) - 1, round(validation * len(lengths))) if validation else 0
        index = megatron_index_bytes(dtype, np.asarray(lengths))
        staged.write(idx, index)
        side = {"format": "fxshard-tokens", "dtype": dtype.name, "eos": renderer.tokenizer.eos_token_id,
                "vocab_size": vocab, "tokens": int(sum(lengths)), "documents": len(lengths),
                "validation_documents": held, "tokenizer": str(Path(tokenizer_dir).resolve()),
                "corpus": str(Path(corpus).resolve()),
                "loss_mask": {"version": MASK_VERSION, "file": out.with_suffix(".mask").name,
                              "dtype": "uint8", "trained_tokens": counts["trained"]},
                "chat": {"format": fmt, "train_on": train_on, "masking": renderer.method, "seq": seq,
                         "truncate": truncate, "longest": max(lengths)} | counts,
                "files": {binary.name: int(sum(lengths)) * dtype.itemsize, mask_file.name: int(sum(lengths)),
                          idx.name: len(index)}}
        staged.write(sidecar, json.dumps(side, indent=1) + "\n")
    return ChatTokenized(out, side["tokens"], len(lengths), held, counts["trained"], counts["truncated"],
                         counts["dropped"], max(lengths), dtype.name, vocab, renderer.method)
