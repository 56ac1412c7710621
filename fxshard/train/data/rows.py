"""The rows of a chat or prompt-completion corpus, each with where it came from (for every refusal).

CORPUS is a ``.jsonl`` file (one JSON object per line: ``file:LINE``), a ``.parquet`` file (needs pyarrow:
``file row N``, from 0), a folder of them (read in name order), or a Hugging Face ``datasets`` folder written
by ``save_to_disk`` (needs the ``datasets`` package: ``folder row N``, as ``dataset[N]``; of a
``DatasetDict``, its ``train`` split)::

    for where, record in corpus_rows(Path("chats.jsonl")):
        record["messages"]      # where == "chats.jsonl:1", ...
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from fxshard.errors import DataError

SUFFIXES = (".jsonl", ".parquet")


def is_datasets_folder(path: Path) -> bool:
    """A folder ``datasets``' ``save_to_disk`` wrote: a Dataset (``state.json``) or a DatasetDict."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def corpus_rows(corpus: Path) -> Iterator[tuple[str, dict]]:
    """Every row of ``corpus`` with its place (see the module docstring)."""
    corpus = Path(corpus)
    if is_datasets_folder(corpus):
        yield from _datasets_rows(corpus)
        return
    if corpus.is_file():
        files = [corpus]
    elif corpus.is_dir():
        files = sorted(p for p in corpus.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    else:
        raise DataError(f"{corpus}: no such file or folder; give a .jsonl or .parquet file, a folder of "
                        "them, or a datasets folder (save_to_disk)")
    if not files:
        raise DataError(f"{corpus}: holds no {' or '.join(SUFFIXES)} file (and is no datasets folder: no "
                        "state.json)")
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_rows(path)
        elif path.suffix == ".parquet":
            yield from _parquet_rows(path)
        else:
            raise DataError(f"{path}: not a file of rows this reads; expected .jsonl or .parquet (chat and "
                            "prompt-completion rows are JSON objects)")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: not a JSON line ({e.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{number}: a {type(record).__name__}; expected a JSON object per "
                                    "line")
                yield f"{path}:{number}", record
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") \
                from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert it to "
                        ".jsonl") from None
    n = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for record in batch.to_pylist():
            yield f"{path} row {n}", record
            n += 1


def _datasets_rows(folder: Path) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{folder}: a datasets folder (save_to_disk) is read with the datasets package; "
                        "install it (pip install 'fxshard[datasets]'), or export the rows to "
                        ".jsonl") from None
    data = datasets.load_from_disk(str(folder))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{folder}: a DatasetDict of splits {sorted(data)} and no 'train'; give the "
                            f"folder of the split to tokenize, e.g. {folder / sorted(data)[0]}")
        folder, data = folder / "train", data["train"]
    for n, record in enumerate(data):
        yield f"{folder} row {n}", record
