"""Token files: a flat binary file of token ids, read through ``numpy.memmap``, and its sidecar.

The file is nanoGPT's ``train.bin`` or Megatron's ``.bin``: token ids back to back, uint16 or uint32 (Megatron:
any integer dtype its index names).  A sidecar gives what the ids alone do not:

- ``PREFIX.idx``, Megatron's index (``MMIDIDX``): the dtype, and the documents as runs of sequences;
- ``PREFIX.json`` (``fxshard data tokenize`` writes it beside its ``.idx``): ``{"dtype": "uint16"}`` at least, and
  optionally ``eos`` (the end-of-document id: documents end after each one when no ``.idx`` gives them),
  ``vocab_size``, ``validation_documents`` (the last N documents are the validation split)::

    tokens = TokenFile.open("data/corpus.bin")
    tokens.tokens, tokens.documents            # 52_428_800, 104_857
    tokens.read(1024, 16)                      # 16 ids from token 1024, a copy (int64)

A read copies its ids and gives the file's pages back (``madvise(MADV_DONTNEED)``), so a rank that streams a
file of any size holds no more of it than one batch: host memory does not grow with the steps.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fxshard.errors import DataError

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
SIDE_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}


@dataclass
class TokenFile:
    path: Path  # the .bin
    dtype: np.dtype
    tokens: int
    starts: np.ndarray | None  # int64 offset of each document's first token (None: no document boundaries known)
    eos: int | None = None
    vocab_size: int | None = None
    validation_documents: int = 0
    sidecar: Path | None = None

    @classmethod
    def open(cls, path: str | Path) -> TokenFile:
        """The token file at ``path`` (``x.bin``, or the prefix ``x`` of ``x.bin``/``x.idx``), with its sidecar."""
        path = Path(path)
        prefix = path.with_suffix("") if path.suffix == ".bin" else path
        binary = prefix.with_suffix(".bin") if path.suffix != ".bin" and not path.is_file() else path
        if not binary.is_file():
            raise DataError(f"{path}: no such token file; give the .bin file that `fxshard data tokenize` (or "
                            "nanoGPT's prepare.py, or Megatron's preprocess_data.py) wrote")
        idx, side = prefix.with_suffix(".idx"), prefix.with_suffix(".json")
        meta = _read_json(side) if side.is_file() else {}
        _check_partners(side, meta, (binary, idx, prefix.with_suffix(".mask")))
        if idx.is_file():
            dtype, starts = read_megatron_index(idx, binary)
        elif "dtype" in meta:
            dtype = _side_dtype(meta["dtype"], side)
            starts = None
        else:
            raise DataError(f"{binary}: no sidecar gives the dtype of its token ids; write {side} holding "
                            '{"dtype": "uint16"} (nanoGPT\'s train.bin holds uint16 ids; uint32 for vocabularies '
                            "over 65,536) and, to know its documents, \"eos\": <end-of-document id>; or write the "
                            "file with `fxshard data tokenize`")
        size = binary.stat().st_size
        if size % np.dtype(dtype).itemsize:
            raise DataError(f"{binary}: {size} bytes is not a whole number of {np.dtype(dtype).name} token ids; the "
                            f"sidecar's dtype is wrong or the file is cut short")
        tokens = size // np.dtype(dtype).itemsize
        eos, vocab = _side_int(meta, "eos", side, 0, None), _side_int(meta, "vocab_size", side, 1, None)
        out = cls(binary, np.dtype(dtype), tokens, starts, eos, vocab, 0, idx if idx.is_file() else side)
        if out.starts is None and out.eos is not None:
            out.starts = out._starts_after_eos()
        held = _side_int(meta, "validation_documents", side, 0, out.documents or 0) or 0
        if held and held >= (out.documents or 0):
            raise DataError(f"{side}: validation_documents {held} leaves no training document of the "
                            f"{out.documents or 0} the file holds; expected fewer (tokenize with a smaller "
                            "--validation)")
        out.validation_documents = held
        return out

    @property
    def documents(self) -> int | None:
        return None if self.starts is None else len(self.starts)

    def document_lengths(self, first: int = 0, last: int | None = None) -> np.ndarray:
        """Lengths of documents ``[first, last)`` (int64)."""
        ends = np.append(self.starts[1:], self.tokens)
        return (ends - self.starts)[first:last]

    def _array(self) -> np.memmap:
        if getattr(self, "_mapped", None) is None:  # opened where it is read: in each DataLoader worker
            self._mapped = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._mapped

    def __getstate__(self):  # a worker maps the file itself rather than inherit a mapping
        return {k: v for k, v in self.__dict__.items() if k != "_mapped"}

    def read(self, start: int, count: int) -> np.ndarray:
        """Token ids ``[start, start + count)`` as int64, copied; the pages read are given back."""
        array = self._array()
        out = np.array(array[start:start + count], dtype=np.int64)
        _release(array, start, count)
        return out

    def id_range(self, start: int = 0, stop: int | None = None, chunk: int = 1 << 24) -> tuple[int, int]:
        """The smallest and the largest id in ``[start, stop)`` (as int64: a uint file's are never negative, an int
        file's may be), read a chunk at a time (its pages given back); ``(0, -1)`` when empty."""
        stop = self.tokens if stop is None else stop
        low, high = None, -1
        for lo in range(start, stop, chunk):
            n = min(chunk, stop - lo)
            part = self._array()[lo:lo + n]
            low = int(part.min()) if low is None else min(low, int(part.min()))
            high = max(high, int(part.max()))
            _release(self._array(), lo, n)
        return (0 if low is None else low), high

    def first_outside(self, low: int, high: int, start: int = 0, stop: int | None = None,
                      chunk: int = 1 << 24) -> int | None:
        """The offset of the first id outside ``[low, high)`` in ``[start, stop)``, or None."""
        stop = self.tokens if stop is None else stop
        for lo in range(start, stop, chunk):
            n = min(chunk, stop - lo)
            part = self._array()[lo:lo + n].astype(np.int64)
            bad = np.flatnonzero((part < low) | (part >= high))
            _release(self._array(), lo, n)
            if len(bad):
                return lo + int(bad[0])
        return None

    def _starts_after_eos(self, chunk: int = 1 << 24) -> np.ndarray:
        """Documents end after each end-of-document id (nanoGPT appends one after every document)."""
        found = [np.zeros(1, dtype=np.int64)]
        for lo in range(0, self.tokens, chunk):
            n = min(chunk, self.tokens - lo)
            found.append(np.flatnonzero(self._array()[lo:lo + n] == self.eos).astype(np.int64) + lo + 1)
            _release(self._array(), lo, n)
        starts = np.concatenate(found)
        return starts[starts < self.tokens]


def _release(array: np.memmap, start: int, count: int) -> None:
    """Drop the pages of ``array[start:start + count]`` from this process (they stay in the page cache)."""
    mm = getattr(array, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or count <= 0:
        return
    size = array.dtype.itemsize
    lo = (start * size) // mmap.PAGESIZE * mmap.PAGESIZE
    hi = min(len(mm), (start + count) * size)
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable JSON sidecar ({e}); it holds at least {{\"dtype\": \"uint16\"}}") \
            from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object such as {{\"dtype\": \"uint16\"}}")
    return data


def _side_int(meta: dict, key: str, where: Path, low: int, high: int | None) -> int | None:
    """The sidecar's integer ``key`` (None when absent), in ``[low, high]``: a hand-made sidecar's ``"two"`` or
    ``-3`` is named, never a traceback or a split that reads outside the file."""
    if key not in meta:
        return None
    value = meta[key]
    if not (isinstance(value, int) and not isinstance(value, bool)) or value < low or \
            (high is not None and value > high):
        bound = f" and at most {high}" if high is not None else ""
        raise DataError(f"{where}: {key} {value!r}; expected a whole number of at least {low}{bound}; fix the "
                        "sidecar, or write the file again with `fxshard data tokenize`")
    return value


def _check_partners(side: Path, meta: dict, partners: tuple[Path, ...]) -> None:
    """The sizes the sidecar recorded of its set's other files (``fxshard data tokenize`` writes them): a ``.bin``
    or ``.idx`` of another write beside it (a copy, a write cut short) is refused, never read as this one."""
    recorded = meta.get("files")
    if not isinstance(recorded, dict):
        return
    for path in partners:
        want = recorded.get(path.name)
        if want is None:
            continue
        found = path.stat().st_size if path.is_file() else None
        if found != want:
            raise DataError(f"{path}: {'missing' if found is None else f'{found} bytes'}, but its sidecar {side} "
                            f"was written with a {path.suffix} of {want} bytes: the files are not one token file's "
                            "(copied from different writes, or a write cut short); tokenize again")


def _side_dtype(name, where: Path) -> np.dtype:
    if name not in SIDE_DTYPES:
        raise DataError(f"{where}: dtype {name!r}; expected one of {', '.join(SIDE_DTYPES)}")
    return SIDE_DTYPES[name]


def read_megatron_index(idx: Path, binary: Path) -> tuple[np.dtype, np.ndarray]:
    """The token dtype and each document's first token offset, from Megatron's ``.idx`` (version 1): header,
    version, dtype code, sequence count, document-index count; then int32 sequence lengths, int64 sequence byte
    pointers and int64 document indices (each document a run of sequences, ``[doc[i], doc[i+1])``)."""
    raw = idx.read_bytes()
    if raw[:9] != MEGATRON_HEADER or len(raw) < 34:
        raise DataError(f"{idx}: not a Megatron index (it starts with {raw[:9]!r}, expected {MEGATRON_HEADER!r})")
    version, code, sequences, doc_indices = struct.unpack_from("<QBQQ", raw, 9)
    if version != 1 or code not in MEGATRON_DTYPES:
        raise DataError(f"{idx}: Megatron index version {version} with dtype code {code}; this reader knows "
                        f"version 1 with codes {sorted(MEGATRON_DTYPES)}")
    if len(raw) != 34 + 12 * sequences + 8 * doc_indices:
        raise DataError(f"{idx}: {len(raw)} bytes, but its header declares {sequences} sequences and {doc_indices} "
                        f"document indices ({34 + 12 * sequences + 8 * doc_indices} bytes): the index is cut short or "
                        "damaged; write it again (`fxshard data tokenize`, or Megatron's preprocess_data.py)")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    lengths = np.frombuffer(raw, np.int32, sequences, 34).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, sequences, 34 + 4 * sequences)
    docs = np.frombuffer(raw, np.int64, doc_indices, 34 + 12 * sequences)
    if sequences and not np.array_equal(pointers, np.concatenate([[0], np.cumsum(lengths[:-1])]) * dtype.itemsize):
        raise DataError(f"{idx}: its sequences do not lie back to back in {binary.name}; fxshard reads a token file "
                        "as one stream of documents (rewrite it with Megatron's merge, or `fxshard data tokenize`)")
    if int(lengths.sum()) * dtype.itemsize != binary.stat().st_size:
        raise DataError(f"{idx}: indexes {int(lengths.sum())} tokens but {binary} holds "
                        f"{binary.stat().st_size // dtype.itemsize}; the two files are not a pair")
    if (lengths < 0).any() or (doc_indices and (docs[0] != 0 or docs[-1] != sequences or (np.diff(docs) < 0).any())):
        raise DataError(f"{idx}: its sequence lengths or document indices are not a partition of its {sequences} "
                        "sequences; the index is damaged: write it again")
    token_starts = np.concatenate([[0], np.cumsum(lengths)])
    return dtype, token_starts[docs[:-1]] if len(docs) > 1 else np.zeros(0, np.int64)


def megatron_index_bytes(dtype: np.dtype, document_lengths: np.ndarray) -> bytes:
    """Megatron's ``.idx`` of a file of documents back to back, one sequence per document."""
    lengths = np.asarray(document_lengths, dtype=np.int64)
    codes = {np.dtype(v): k for k, v in MEGATRON_DTYPES.items()}
    pointers = np.concatenate([[0], np.cumsum(lengths)])[:-1].astype(np.int64) * np.dtype(dtype).itemsize
    header = MEGATRON_HEADER + struct.pack("<QBQQ", 1, codes[np.dtype(dtype)], len(lengths), len(lengths) + 1)
    return header + lengths.astype(np.int32).tobytes() + pointers.tobytes() \
        + np.arange(len(lengths) + 1, dtype=np.int64).tobytes()
