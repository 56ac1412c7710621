"""``--data PATH``: a token file as a map-style dataset of sequences of the compiled length.

Unpacked, example ``i`` of a split is the ``S`` tokens from ``lo + i·S`` (the file read as one stream, as nanoGPT
and Megatron do: a sequence may span documents); packed (``--pack``), it is packed sequence ``i``
(:mod:`fxshard.train.data.packing`).  The compiled forward names what an example fills (the Hugging Face causal-LM
convention): ``input_ids`` and ``labels`` (the same ids: the model shifts them), ``position_ids`` (0..S-1, or
restarting per document when packed) and ``attention_mask`` (ones; not with ``--pack``).  A token file with a
loss mask (chat data, :mod:`fxshard.train.data.loss_mask`) is read one conversation per example: right-padded
unpacked, whole conversations packed; its labels are -100 where the mask is 0::

    source = token_source(model_file, spec, "train", DataOptions(data=Path("corpus.bin")))
    source.dataset[0]      # {"input_ids": tensor([...16 ids]), "labels": tensor([...])}

A model whose forward takes other inputs reads the file from its own ``make_dataset`` (:class:`TokenFile`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fxshard.errors import DataError
from fxshard.train.data.loss_mask import LossMask, check_conversations_fit, conversation_row
from fxshard.train.data.options import DataOptions
from fxshard.train.data.packing import Packed, pack, packed_row, unpacked_padding
from fxshard.train.data.spec import BatchSpec, Source
from fxshard.train.data.tokens import TokenFile

FILLED = ("input_ids", "labels", "position_ids", "attention_mask")


@dataclass
class SplitRange:
    """The part of a token file one split reads: tokens ``[lo, hi)``, documents ``[first_doc, last_doc)``."""

    file: TokenFile
    lo: int
    hi: int
    first_doc: int | None = None
    last_doc: int | None = None

    def document_table(self) -> tuple[np.ndarray, np.ndarray]:
        """File offsets and lengths of the split's documents."""
        f = self.file
        return f.starts[self.first_doc:self.last_doc], f.document_lengths(self.first_doc, self.last_doc)


class TokenWindows(torch.utils.data.Dataset):
    """The sequences of one split of a token file, as examples of the compiled row."""

    def __init__(self, split: SplitRange, spec: BatchSpec, packed: Packed | None,
                 mask: LossMask | None = None, ids=None, name: str = "train"):
        self.split, self.spec, self.packed, self.mask, self.ids, self.name = split, spec, packed, mask, ids, name
        self.seq = _sequence_length(spec)
        self.pad_id = split.file.eos if split.file.eos is not None else 0
        self.fills = [c.key for c in spec.columns]
        self.dtypes = {c.key: c.dtype for c in spec.columns}

    def __len__(self) -> int:
        if self.packed is not None:
            return self.packed.sequences
        if self.mask is not None:  # one conversation per sequence
            return self.split.last_doc - self.split.first_doc
        return (self.split.hi - self.split.lo) // self.seq

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        if self.packed is not None:
            segments = self.packed.segments(i)
            ids = [self.split.file.read(s, n) for s, n in segments]
            self._check(np.concatenate(ids) if ids else np.zeros(0, np.int64), i)
            masks = None if self.mask is None else [self.mask.read(s, n) for s, n in segments]
            input_ids, labels, positions = packed_row(ids, self.seq, self.pad_id, masks)
            values = {"input_ids": input_ids, "labels": labels, "position_ids": positions}
        elif self.mask is not None:
            start, n = self._conversation(i)
            ids, mask = self.split.file.read(start, n), self.mask.read(start, n)
            self._check(ids, i)
            input_ids, labels, attention = conversation_row(ids, mask, self.seq, self.pad_id)
            values = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
        else:
            input_ids = self.split.file.read(self.split.lo + i * self.seq, self.seq)
            self._check(input_ids, i)
            values = {"input_ids": input_ids, "labels": input_ids}
        return {k: self._tensor(values.get(k), k) for k in self.fills}

    def _check(self, ids: np.ndarray, i: int) -> None:
        """The ids of sequence ``i`` are in the vocabulary, as they are read (the file may have changed since the
        check before launch, or never had one: a user's own loop)."""
        if self.ids is not None:
            self.ids.check_array(ids, f"{self.split.file.path}: sequence {i} of the {self.name} split (from token "
                                      f"{self.token_offset(i)})")

    def _tensor(self, value, key: str) -> torch.Tensor:
        if value is None:  # unpacked position ids, and the attention mask (no padding)
            return torch.arange(self.seq, dtype=self.dtypes[key]) if key == "position_ids" else \
                torch.ones(self.seq, dtype=self.dtypes[key])
        return torch.from_numpy(value).to(self.dtypes[key])

    def _conversation(self, i: int) -> tuple[int, int]:
        """File offset and length of the split's conversation ``i``."""
        d = self.split.first_doc + i
        f = self.split.file
        end = int(f.starts[d + 1]) if d + 1 < len(f.starts) else f.tokens
        return int(f.starts[d]), end - int(f.starts[d])

    def token_offset(self, i: int) -> int:
        """Where example ``i`` starts in the file."""
        if self.packed is not None:
            return int(self.packed.start[self.packed.first[i]])
        if self.mask is not None:
            return self._conversation(i)[0]
        return self.split.lo + i * self.seq

    def cursor(self, order, position: int) -> dict:
        """The token-file cursor of stream ``position``: the file, and the offset of the next example's tokens."""
        n = len(self)
        nxt = order.indices(position, 1)[0] if n else 0
        return {"file": str(self.split.file.path), "token_offset": self.token_offset(nxt) if n else None,
                "sequence": nxt, "packed": self.packed is not None}

    def padding(self) -> dict | None:
        """Packed: the padding fraction with packing and with one document per sequence, over this split."""
        if self.packed is None:
            return None
        _, lengths = self.split.document_table()
        return {"packed": self.packed.padding, "unpacked": unpacked_padding(lengths, self.seq),
                "sequences": self.packed.sequences, "documents": int(len(lengths))}


def _sequence_length(spec: BatchSpec) -> int:
    return spec.column("input_ids").row_shape[0]


def check_token_inputs(mf, spec: BatchSpec, options: DataOptions) -> None:
    """Refuse ``--data`` (and ``--pack``) for a compiled forward the token source cannot fill, naming the fix."""
    keys = [str(k) for k in spec.keys]
    where = f"{mf.path}"
    if spec.positional or "input_ids" not in keys or any(k not in FILLED for k in keys) or \
            len(spec.column("input_ids").row_shape) != 1:
        raise DataError(f"--data {options.data}: {where} takes inputs {keys}; a token file fills a forward taking "
                        f"input_ids [B, S] and any of {', '.join(FILLED[1:])} by keyword (a Hugging Face causal LM). "
                        "Read the file in the model file's own make_dataset(split) instead, with "
                        "fxshard.train.data.tokens.TokenFile (docs/data.md)")
    if options.pack:
        from fxshard.train.data.document_masks import check_document_masks

        check_document_masks(mf, spec, options)


def split_range(file: TokenFile, split: str, options: DataOptions) -> SplitRange:
    """Tokens ``[lo, hi)`` of ``split``: all of ``--eval-data``'s file; else the sidecar's last
    ``validation_documents`` documents are validation and the rest train."""
    held = file.validation_documents if file.starts is not None else 0
    if split == "validation" and (options.eval_data is not None or _nanogpt_val(options) is not None):
        return SplitRange(file, 0, file.tokens, 0 if file.starts is not None else None, None)
    docs = file.documents or 0
    if split == "validation":
        if not held:
            raise DataError(f"{file.path}: no validation split: its sidecar {file.sidecar} names no "
                            "validation_documents; pass --eval-data PATH (a token file), or tokenize with "
                            "--validation N")
        return SplitRange(file, int(file.starts[docs - held]), file.tokens, docs - held, docs)
    hi = int(file.starts[docs - held]) if held else file.tokens
    return SplitRange(file, 0, hi, 0 if file.starts is not None else None, docs - held if file.starts is not None
                      else None)


def _nanogpt_val(options: DataOptions) -> Path | None:
    """nanoGPT's val.bin beside its train.bin (with its own sidecar), when no --eval-data is given."""
    data = Path(options.data)
    if data.name == "train.bin" and (data.parent / "val.bin").is_file():
        return data.parent / "val.bin"
    return None


_PACKED: dict[tuple, Packed] = {}  # the packing of a file's split, made once per process


def _packed(part: SplitRange, seq: int) -> Packed:
    stat = part.file.path.stat()
    key = (str(part.file.path.resolve()), stat.st_size, stat.st_mtime_ns, part.first_doc, part.last_doc, seq)
    if key not in _PACKED:
        if len(_PACKED) > 4:
            _PACKED.clear()
        _PACKED[key] = pack(*part.document_table(), seq)
    return _PACKED[key]


def token_source(mf, spec: BatchSpec, split: str, options: DataOptions, manifest=None) -> Source:
    """The token file of ``split`` as a :class:`~fxshard.train.data.spec.Source` of sequences."""
    check_token_inputs(mf, spec, options)
    path = options.data
    if split == "validation":
        path = options.eval_data or _nanogpt_val(options) or options.data
    file = TokenFile.open(path)
    part = split_range(file, split, options)
    mask = LossMask.beside(file)
    if mask is not None:
        check_conversations_fit(file, part.document_table()[1], part.first_doc, _sequence_length(spec), split)
    packed = None
    if options.pack:
        if file.starts is None:
            raise DataError(f"--pack: {file.path} has no document boundaries (no Megatron .idx, and its sidecar "
                            f"{file.sidecar} names no eos id); add \"eos\": <id> to the sidecar, or tokenize it "
                            "with `fxshard data tokenize`")
        packed = _packed(part, _sequence_length(spec))
    what = "packed sequences" if packed is not None else "sequences"
    if mask is not None:
        how = "packed in" if packed is not None else "one per"
        what = f"conversations with their loss mask, {how} sequences"
    from fxshard.train.data.ids import token_ids

    return Source("tokens", f"{file.path} ({split}, {what} of {_sequence_length(spec)} tokens)",
                  dataset=TokenWindows(part, spec, packed, mask, token_ids(mf), split))
