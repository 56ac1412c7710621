"""The loss mask of a token file: which tokens are trained, one byte per token beside the ids.

``fxshard data tokenize --format chat`` writes ``X.mask`` beside ``X.bin``: uint8, aligned with the ids
(``mask[t] == 1``: token ``t`` is a target, predicted from token ``t - 1``), and names it in ``X.json`` under
``"loss_mask"`` (``{"version": 1, "file": "X.mask", "dtype": "uint8", "trained_tokens": N}``).  Its documents
(the ``.idx``) are conversations.  The model sees the mask as labels in the Hugging Face convention (the model
shifts them): the id where the mask is 1, -100 where it is 0::

    mask = LossMask.beside(TokenFile.open("chat.bin"))
    mask.read(0, 16)                          # 16 bytes of 0 and 1, a copy
    masked_labels(ids, mask.read(0, len(ids)))

A masked file is read one conversation per example: unpacked, each sequence holds one conversation,
right-padded (padding labelled -100 and, where the model takes one, attention mask 0); packed, each
conversation keeps its own attention block.  A conversation longer than the compiled sequence is refused
before launch (tokenize with ``--seq S --truncate``), never cut silently. """

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fxshard.errors import DataError
from fxshard.train.data.packing import IGNORE
from fxshard.train.data.tokens import TokenFile, _release

MASK_VERSION = 1


@dataclass
class LossMask:
    path: Path
    tokens: int
    trained: int | None = None

    @classmethod
    def beside(cls, file: TokenFile) -> LossMask | None:
        """The loss mask ``file``'s ``.json`` sidecar names, checked against the ids; None if it names
        none."""
        side = file.path.with_suffix(".json")
        if not side.is_file():
            return None
        try:
            meta = json.loads(side.read_text())
        except (OSError, ValueError):
            return None  # TokenFile.open read the same sidecar and said what is wrong with it
        entry = meta.get("loss_mask") if isinstance(meta, dict) else None
        if entry is None:
            return None
        if not isinstance(entry, dict) or entry.get("version") != MASK_VERSION \
                or entry.get("dtype") != "uint8" or not isinstance(entry.get("file"), str):
            raise DataError(f"{side}: loss_mask {entry!r:.120}; this fxshard reads version {MASK_VERSION} "
                            '({"version": 1, "file": "NAME.mask", "dtype": "uint8"}); tokenize the corpus '
                            "again")
        path = file.path.parent / Path(entry["file"]).name  # beside the ids, whatever folder it names
        if not path.is_file():
            raise DataError(f"{side}: names the loss mask {path.name}, which is not beside {file.path.name}; "
                            "copy the token file with its .mask, .idx and .json")
        if path.stat().st_size != file.tokens:
            raise DataError(f"{path}: {path.stat().st_size} mask bytes for the {file.tokens} tokens of "
                            f"{file.path.name}; the two files are not a pair (tokenize the corpus again)")
        if file.starts is None:
            raise DataError(f"{file.path}: a loss mask without conversation boundaries (no .idx beside it); "
                            "tokenize the corpus again")
        return cls(path, file.tokens, entry.get("trained_tokens"))

    def _array(self) -> np.memmap:
        if getattr(self, "_mapped", None) is None:  # mapped where it is read: in each DataLoader worker
            self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mapped

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_mapped"}

    def read(self, start: int, count: int) -> np.ndarray:
        """Mask bytes ``[start, start + count)``, copied; the pages read are given back."""
        array = self._array()
        out = np.array(array[start:start + count], dtype=np.uint8)
        _release(array, start, count)
        return out


def masked_labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Labels in the Hugging Face convention: the id where the mask is 1, -100 (not a target) where it is
    0."""
    return np.where(mask.astype(bool), ids, IGNORE).astype(np.int64)


def conversation_row(ids: np.ndarray, mask: np.ndarray, seq: int, pad_id: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One unpacked example: a conversation right-padded to ``seq``: input ids, labels and attention mask."""
    n = len(ids)
    assert n <= seq, (n, seq)  # longer conversations are refused before launch (check_conversations_fit)
    input_ids = np.full(seq, pad_id, dtype=np.int64)
    labels = np.full(seq, IGNORE, dtype=np.int64)
    attention = np.zeros(seq, dtype=np.int64)
    input_ids[:n], labels[:n], attention[:n] = ids, masked_labels(ids, mask), 1
    return input_ids, labels, attention


def check_conversations_fit(file: TokenFile, lengths: np.ndarray, first_doc: int, seq: int,
                            split: str) -> None:
    """Refuse a split holding a conversation longer than the compiled sequence, naming it and the fix."""
    if not len(lengths) or int(lengths.max()) <= seq:
        return
    k = int(np.argmax(lengths))
    over = int((lengths > seq).sum())
    raise DataError(f"{file.path}: conversation {first_doc + k} of the {split} split is {int(lengths[k])} "
                    f"tokens, longer than the compiled sequence of {seq} ({over} of its conversations "
                    f"{'is' if over == 1 else 'are'}); a conversation is never cut silently: tokenize again "
                    f"with --seq {seq} --truncate right (keep each one's first tokens) or --truncate drop "
                    "(leave them out), or compile a longer sequence")


def mask_summary(windows) -> dict:
    """What the launch says of a masked split (:class:`~fxshard.train.data.windows.TokenWindows`): its
    conversations, the targets they train, and, unpacked, the padding of one conversation per sequence."""
    from fxshard.train.data.packing import unpacked_padding

    part, mask = windows.split, windows.mask
    chunk = 1 << 24
    trained = sum(int(mask.read(lo, min(chunk, part.hi - lo)).sum()) for lo in range(part.lo, part.hi, chunk))
    _, lengths = part.document_table()
    out = {"conversations": int(len(lengths)), "trained_tokens": trained}
    if windows.packed is None:
        out["conversation_padding"] = unpacked_padding(lengths, windows.seq)
    return out
