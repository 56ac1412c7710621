"""``fxshard data tokenize CORPUS --tokenizer DIR --out PATH``: text to a token file ``--data`` reads.

CORPUS is a file or a folder of files (read in name order): ``.txt`` (documents separated by a blank line),
``.jsonl`` (one JSON object per line, the document in ``--text-field``, default ``text``) or ``.parquet`` (that
column; needs ``pyarrow``).  DIR is a local Hugging Face tokenizer folder (its ``tokenizer.json``, read with the
``tokenizers`` library; the end-of-document token from ``tokenizer_config.json``'s ``eos_token`` or ``--eos``).
Each document's ids are followed by EOS.  Written: ``PATH`` (ids back to back, uint16 for a vocabulary of up to
65,536 ids, else int32), ``PATH.idx`` with ``.bin`` replaced (Megatron's index: one sequence per document) and the
``.json`` sidecar (dtype, eos, vocabulary size, counts, how many of the last documents are the validation split, the
sizes of its two partners), as one set (:class:`fxshard.files.FileSet`, :func:`token_file_members`): the old set
stays whole until the new one is complete, and a file fxshard did not write is never replaced::

    summary = tokenize("corpus/", Path("tok"), Path("data/corpus.bin"), validation=0.005)
    summary.tokens, summary.documents
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fxshard.errors import DataError
from fxshard.files import FileSet
from fxshard.train.data.tokens import megatron_index_bytes

SUFFIXES = (".txt", ".jsonl", ".parquet")
CHUNK = 512  # documents encoded together (the tokenizers library spreads a batch over its threads)


@dataclass(frozen=True)
class Tokenized:
    path: Path
    tokens: int
    documents: int
    validation_documents: int
    dtype: str
    eos: int
    vocab_size: int


def corpus_files(corpus: Path) -> list[Path]:
    """The corpus's text files, in name order."""
    corpus = Path(corpus)
    if corpus.is_file():
        files = [corpus]
    elif corpus.is_dir():
        files = sorted(p for p in corpus.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    else:
        raise DataError(f"{corpus}: no such file or folder; give a .txt, .jsonl or .parquet file or a folder of them")
    bad = [p for p in files if p.suffix not in SUFFIXES]
    if bad:
        raise DataError(f"{bad[0]}: not a corpus file this reads; expected {', '.join(SUFFIXES)}")
    if not files:
        raise DataError(f"{corpus}: holds no {', '.join(SUFFIXES)} file")
    return files


def token_file_members(out: Path) -> dict[Path, str]:
    """The files of the token file ``out`` (``PREFIX.bin``), what each is: one set, written together.  A member a
    write does not write (the loss mask of plain text) is deleted with the switch, if an earlier write left one."""
    prefix = Path(out).with_suffix("")
    return {prefix.with_suffix(".bin"): "a token file's ids",
            prefix.with_suffix(".mask"): "a token file's loss mask",
            prefix.with_suffix(".idx"): "a token file's index",
            prefix.with_suffix(".json"): "a token file's sidecar"}  # last: it records its partners' sizes


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one corpus file; text that is not UTF-8 is named with its file and line."""
    try:
        yield from _documents(path, text_field)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start} of a "
                        f"line, {e.reason}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _documents(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == ".txt":
        yield from _txt_documents(path)
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: not a JSON line ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise DataError(f"{path}:{number}: no string field {text_field!r}; name the text's field "
                                    "with --text-field")
                yield record[text_field]
    else:
        yield from _parquet_documents(path, text_field)


def _txt_documents(path: Path) -> Iterator[str]:
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert it to .jsonl") \
            from None
    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise DataError(f"{path}: no column {text_field!r} (columns {table.schema_arrow.names}); name it with "
                        "--text-field")
    for batch in table.iter_batches(columns=[text_field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def load_tokenizer(folder: Path, eos: str | None = None):
    """The tokenizer of a local Hugging Face folder and its end-of-document id."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    file = folder / "tokenizer.json" if folder.is_dir() else folder
    if not file.is_file():
        raise DataError(f"--tokenizer {folder}: no tokenizer.json; give a local Hugging Face tokenizer folder (as "
                        "save_pretrained writes it) or its tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library's own error: a message, not a type to catch
        raise DataError(f"--tokenizer {folder}: {file} is not a tokenizer the tokenizers library reads ({e}); give "
                        "the tokenizer.json that save_pretrained wrote") from None
    if eos is None:
        config = file.parent / "tokenizer_config.json"
        if config.is_file():
            eos = _configured_eos(config)
    if eos is None:
        raise DataError(f"--tokenizer {folder}: no eos_token in tokenizer_config.json; name the end-of-document "
                        "token with --eos, e.g. --eos '</s>'")
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise DataError(f"--tokenizer {folder}: the end-of-document token {eos!r} is not in its vocabulary")
    return tokenizer, eos_id


def _configured_eos(config: Path) -> str | None:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{config}: not JSON ({e}); fix it, or name the end-of-document token with --eos") from None
    if not isinstance(data, dict):
        raise DataError(f"{config}: a JSON {type(data).__name__}, expected an object holding \"eos_token\"; fix it, "
                        "or name the end-of-document token with --eos")
    value = data.get("eos_token")
    value = value.get("content") if isinstance(value, dict) else value
    if value is not None and not isinstance(value, str):
        raise DataError(f"{config}: eos_token {value!r}, expected the token's text; fix it, or pass --eos")
    return value


def tokenize(corpus: Path, tokenizer_dir: Path, out: Path, validation: float = 0.0, text_field: str = "text",
             eos: str | None = None, progress: Callable[[int, int], None] | None = None) -> Tokenized:
    """Tokenize ``corpus`` into the token file ``out`` (see the module docstring).  ``validation``: the fraction
    of documents (the last ones) held out as the validation split.  ``progress(done, total)`` gets corpus bytes."""
    out = Path(out)
    if out.suffix != ".bin":
        raise DataError(f"--out {out}: name the token file PATH.bin (its .idx and .json sidecars go beside it)")
    if not out.parent.is_dir():
        raise DataError(f"--out {out}: the folder {out.parent} does not exist; create it first")
    files = corpus_files(corpus)
    tokenizer, eos_id = load_tokenizer(tokenizer_dir, eos)
    vocab = tokenizer.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)
    members = token_file_members(out)
    binary, _, idx, sidecar = members
    with FileSet(members) as staged:  # every member refused now (a link, a folder, not fxshard's), before the work
        with staged.open(binary) as sink:
            lengths = _encode(files, tokenizer, eos_id, dtype, text_field, sink, progress)
        if not lengths:
            raise DataError(f"{corpus}: holds no document (no text in {', '.join(p.name for p in files)})")
        held = min(len(lengths) - 1, round(validation * len(lengths))) if validation else 0
        index = megatron_index_bytes(dtype, np.asarray(lengths))
        staged.write(idx, index)
        side = {"format": "fxshard-tokens", "dtype": dtype.name, "eos": eos_id, "vocab_size": vocab,
                "tokens": int(sum(lengths)), "documents": len(lengths), "validation_documents": held,
                "tokenizer": str(Path(tokenizer_dir).resolve()), "corpus": str(Path(corpus).resolve()),
                "files": {binary.name: int(sum(lengths)) * dtype.itemsize, idx.name: len(index)}}
        staged.write(sidecar, json.dumps(side, indent=1) + "\n")
    return Tokenized(out, side["tokens"], len(lengths), held, dtype.name, eos_id, vocab)


def _encode(files: list[Path], tokenizer, eos_id: int, dtype, text_field: str, sink, progress) -> list[int]:
    """Write every document's ids and its EOS to ``sink``; the documents' lengths."""
    total = sum(p.stat().st_size for p in files)
    lengths: list[int] = []
    done = 0
    for path in files:
        for chunk in _chunks(documents(path, text_field)):
            for enc in tokenizer.encode_batch(chunk, add_special_tokens=False):
                ids = np.asarray(enc.ids + [eos_id], dtype=dtype)
                sink.write(ids.tobytes())
                lengths.append(len(ids))
            if progress is not None:  # bytes of text: an estimate within a file, exact at its end
                done = min(total, done + sum(len(t.encode()) for t in chunk))
                progress(done, total)
        if progress is not None:
            done = sum(p.stat().st_size for p in files[:files.index(path) + 1])
            progress(done, total)
    return lengths


def _chunks(texts: Iterator[str]) -> Iterator[list[str]]:
    chunk = []
    for t in texts:
        chunk.append(t)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
