"""Data that would train silently wrong, or fail with a traceback, is refused by name (issue 45 items 4, 6, 13, 14,
15): token ids outside the vocabulary from every source (before launch and as they are read), hand-made sidecars
and indexes, a re-tokenize that fails half-way, a corpus that is not UTF-8 or a tokenizer that does not read, and
packed documents with nothing to predict.  Each builds the real bad file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fxshard.capture.modelfile import load_model_file
from fxshard.errors import DataError
from fxshard.train.data import DataOptions, global_batches
from fxshard.train.data.checks import check_model_data
from fxshard.train.data.tokenize import tokenize
from fxshard.train.data.tokens import TokenFile

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "samples" / "llama.py"
PACKED = ROOT / "tests" / "models" / "packed_llama.py"
DATASET = ROOT / "tests" / "models" / "dataset_llama.py"


def _ids(folder: Path, name: str, ids, dtype: str = "int32", **side) -> Path:
    np.asarray(ids, dtype=dtype).tofile(folder / f"{name}.bin")
    (folder / f"{name}.json").write_text(json.dumps({"dtype": dtype, **side}))
    return folder / f"{name}.bin"


# ---------------------------------------------------------------- item 6: ids in [0, vocab), every source


@pytest.mark.parametrize("bad", [-1, -100, 256])
def test_a_token_id_outside_the_vocabulary_is_refused_before_launch_naming_where(tmp_path, bad):
    ids = np.arange(2000) % 256
    ids[1234] = bad
    path = _ids(tmp_path, "bad", ids)
    with pytest.raises(DataError, match=rf"bad.bin: token id {bad} in the train split, but .*llama.py's model has a "
                                        r"vocabulary of 256 .*the first such id is token 1234 of the file"):
        check_model_data(load_model_file(LLAMA), options=DataOptions(data=path))


def test_a_token_id_outside_the_vocabulary_is_refused_as_it_is_read(tmp_path):
    """The check before launch saw a good file; the file changed since (or a user's own loop never checked it)."""
    ids = np.arange(2000) % 256
    path = _ids(tmp_path, "t", ids)
    batches = global_batches(LLAMA, options=DataOptions(data=path, shuffle=False))
    next(batches)
    changed = ids.copy()
    changed[4 * 16 + 3] = -1  # sequence 4 (the second batch's first row), position 3
    changed.astype(np.int32).tofile(path)
    with pytest.raises(DataError, match=r"t.bin: sequence 4 of the train split \(from token 64\): token id -1 "
                                        r"\(position 3 of the example\), but the model's vocabulary has 256 ids"):
        next(batches)


def _bad_dataset(folder: Path, bad_rows: str) -> Path:
    model = folder / "model.py"
    model.write_text(DATASET.read_text().replace(
        "    return {\"input_ids\": ids, \"labels\": ids.clone()}",
        f"    if i in {bad_rows}:\n        ids[5] = VOCAB + 3\n"
        "    return {\"input_ids\": ids, \"labels\": ids.clone()}"))
    return model


def test_a_make_dataset_example_outside_the_vocabulary_is_refused_by_its_index(tmp_path):
    batches = global_batches(_bad_dataset(tmp_path, "(7,)"), options=DataOptions(shuffle=False, data_workers=0))
    next(batches)  # examples 0..3
    with pytest.raises(DataError, match=r"make_dataset\('train'\)\[7\]: input 'input_ids' holds token id 259 at "
                                        r"\[5\], but the model's vocabulary has 256 ids \(0..255\)"):
        next(batches)
    (tmp_path / "b").mkdir()
    first = _bad_dataset(tmp_path / "b", "(0,)")  # before launch: the first example is read
    with pytest.raises(DataError, match=r"make_dataset\('train'\)\[0\]: input 'input_ids' holds token id 259"):
        check_model_data(load_model_file(first), options=DataOptions())


# ---------------------------------------------------------------- items 13 and 15: hand-made sidecars and indexes


@pytest.mark.parametrize("value, said", [
    ('"two"', "validation_documents 'two'; expected a whole number of at least 0"),
    ("-3", "validation_documents -3; expected a whole number of at least 0"),
    ("1000000", "validation_documents 1000000; expected a whole number of at least 0 and at most"),
    ("true", "validation_documents True; expected a whole number"),
])
def test_a_hand_made_sidecar_value_is_named(tmp_path, value, said):
    path = _ids(tmp_path, "t", np.arange(600) % 255, eos=255)
    side = json.loads((tmp_path / "t.json").read_text())
    (tmp_path / "t.json").write_text(json.dumps(side)[:-1] + f', "validation_documents": {value}}}')
    with pytest.raises(DataError, match=rf"t.json: {said}"):
        TokenFile.open(path)


def test_a_truncated_or_empty_index_is_named(corpus, tmp_path):
    root, _ = corpus
    for suffix in (".bin", ".idx"):
        shutil.copy(root / f"t{suffix}", tmp_path / f"t{suffix}")
    raw = (root / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(raw[:-100])
    with pytest.raises(DataError, match=r"t.idx: \d+ bytes, but its header declares \d+ sequences and \d+ document "
                                        r"indices \(\d+ bytes\): the index is cut short or damaged"):
        TokenFile.open(tmp_path / "t.bin")
    import struct

    from fxshard.train.data.tokens import MEGATRON_HEADER

    zero = MEGATRON_HEADER + struct.pack("<QBQQ", 1, 8, 0, 1) + np.zeros(1, np.int64).tobytes()  # 0 sequences, uint16
    (tmp_path / "t.idx").write_bytes(zero)
    with pytest.raises(DataError, match=r"t.idx: indexes 0 tokens but .*t.bin holds \d+; the two files are not a pair"):
        TokenFile.open(tmp_path / "t.bin")


def test_a_set_whose_members_are_of_different_writes_is_named(corpus, tmp_path):
    root, _ = corpus
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(root / f"t{suffix}", tmp_path / f"t{suffix}")
    with open(tmp_path / "t.bin", "ab") as f:
        f.write(b"\0\0")  # a .bin of another write beside this sidecar
    with pytest.raises(DataError, match=r"t.bin: \d+ bytes, but its sidecar .*t.json was written with a .bin of \d+ "
                                        r"bytes: the files are not one token file's"):
        TokenFile.open(tmp_path / "t.bin")


# ---------------------------------------------------------------- item 4: a failed re-tokenize


def test_a_failed_retokenize_leaves_the_working_token_file_whole(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    out = tmp_path / "t.bin"
    tokenize(root / "corpus", root / "tok", out)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    class FullDisk:  # the sidecar, written last, fails: the disk is full by then
        loads = staticmethod(json.loads)

        @staticmethod
        def dumps(*args, **kwargs):
            raise OSError(28, "No space left on device")

    import fxshard.train.data.tokenize as module

    monkeypatch.setattr(module, "json", FullDisk)
    with pytest.raises(OSError, match="No space left"):  # another corpus: every one of the three files would change
        tokenize(root / "corpus" / "part-000.jsonl", root / "tok", out, validation=0.5)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the old set, whole, and nothing else
    assert TokenFile.open(out).documents == 300


def test_tokenize_names_text_that_is_not_utf8_and_a_tokenizer_that_does_not_read(corpus, tmp_path):
    root, _ = corpus
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 text .*convert it to UTF-8"):
        tokenize(bad, root / "tok", tmp_path / "t.bin")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(DataError, match=r"tokenizer.json is not a tokenizer the tokenizers library reads"):
        tokenize(root / "corpus", tok, tmp_path / "t.bin")
    shutil.copy(root / "tok" / "tokenizer.json", tok / "tokenizer.json")
    for config, said in (("[1, 2]", r"a JSON list, expected an object holding \"eos_token\""),
                         ("{eos", r"not JSON"), ('{"eos_token": 5}', r"eos_token 5, expected the token's text")):
        (tok / "tokenizer_config.json").write_text(config)
        with pytest.raises(DataError, match=rf"tokenizer_config.json: {said}"):
            tokenize(root / "corpus", tok, tmp_path / "t.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.txt", "tok"]  # nothing written by the refusals


# ---------------------------------------------------------------- item 14: packed documents with nothing to predict


def test_pack_on_documents_of_one_token_is_refused_as_having_no_label(tmp_path):
    eos = 255
    path = _ids(tmp_path, "empty", np.full(400, eos), dtype="uint16", eos=eos, vocab_size=256)
    with pytest.raises(DataError, match=r"--pack: .*empty.bin: no position of the train split has a label: each of its "
                                        r"400 documents is a single token"):
        check_model_data(load_model_file(PACKED), options=DataOptions(data=path, pack=True))
