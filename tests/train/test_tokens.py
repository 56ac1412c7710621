"""Token files: ``fxshard data tokenize`` writes what Megatron and nanoGPT readers read; ``--data`` gives every dp
rank its own sequences of the one-device order; ``--pack`` keeps documents whole with restarting positions; bad
token files and models that cannot pack are refused before launch, by name."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.errors import DataError
from fxshard.train.data import DataOptions, global_batches, open_batches
from fxshard.train.data.checks import check_model_data
from fxshard.train.data.packing import IGNORE
from fxshard.train.data.tokenize import documents, load_tokenizer, tokenize
from fxshard.train.data.tokens import TokenFile, read_megatron_index

ROOT = Path(__file__).resolve().parent.parent.parent
LLAMA = ROOT / "samples" / "llama.py"
PACKED = ROOT / "tests" / "models" / "packed_llama.py"


def test_tokenize_writes_each_document_then_eos_with_a_megatron_index(corpus):
    root, summary = corpus
    tokens = TokenFile.open(root / "t.bin")
    assert (tokens.documents, tokens.validation_documents, tokens.dtype) == (300, 30, np.uint16)
    assert summary.tokens == tokens.tokens == int(tokens.document_lengths().sum())
    tokenizer, eos = load_tokenizer(root / "tok")
    texts = [t for p in sorted((root / "corpus").glob("*.jsonl")) for t in documents(p)]
    for d in (0, 150, 299):
        start, n = int(tokens.starts[d]), int(tokens.document_lengths()[d])
        assert tokens.read(start, n).tolist() == tokenizer.encode(texts[d], add_special_tokens=False).ids + [eos]
    dtype, starts = read_megatron_index(root / "t.idx", root / "t.bin")
    assert dtype == np.uint16 and np.array_equal(starts, tokens.starts)
    # the same text as .txt (documents between blank lines) tokenizes to the same file
    (root / "txt").mkdir()
    (root / "txt" / "c.txt").write_text("\n\n".join(texts) + "\n")
    tokenize(root / "txt" / "c.txt", root / "tok", root / "txt" / "t.bin")
    assert (root / "txt" / "t.bin").read_bytes() == (root / "t.bin").read_bytes()


def test_a_parquet_corpus_tokenizes_as_its_jsonl(corpus, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root, _ = corpus
    texts = [t for p in sorted((root / "corpus").glob("*.jsonl")) for t in documents(p)]
    pq.write_table(pa.table({"body": texts}), tmp_path / "c.parquet", row_group_size=64)
    tokenize(tmp_path / "c.parquet", root / "tok", tmp_path / "t.bin", validation=0.1, text_field="body")
    assert (tmp_path / "t.bin").read_bytes() == (root / "t.bin").read_bytes()
    assert (tmp_path / "t.idx").read_bytes() == (root / "t.idx").read_bytes()


def test_a_nanogpt_file_finds_its_documents_from_eos(corpus, tmp_path):
    root, summary = corpus
    (tmp_path / "train.bin").write_bytes((root / "t.bin").read_bytes())
    (tmp_path / "train.json").write_text(json.dumps({"dtype": "uint16", "eos": summary.eos}))
    assert np.array_equal(TokenFile.open(tmp_path / "train.bin").starts, TokenFile.open(root / "t.bin").starts)
    (tmp_path / "train.json").unlink()
    with pytest.raises(DataError, match=r"train.bin: no sidecar gives the dtype .* write .*train.json"):
        TokenFile.open(tmp_path / "train.bin")


def test_a_megatron_index_of_several_sequences_per_document(tmp_path):
    """An index as Megatron's _IndexWriter lays it out (header, version, dtype code, sequence count, document-index
    count; int32 lengths, int64 byte pointers, int64 document indices), documents of 2, 1 and 3 sequences."""
    import struct

    lengths = [3, 4, 2, 5, 1, 6]
    documents = [0, 2, 3, 6]
    np.arange(sum(lengths), dtype=np.int32).tofile(tmp_path / "m.bin")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 4
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents)))
        f.write(np.array(lengths, np.int32).tobytes() + pointers.astype(np.int64).tobytes())
        f.write(np.array(documents, np.int64).tobytes())
    tokens = TokenFile.open(tmp_path / "m")  # the prefix, as Megatron names a dataset
    assert tokens.dtype == np.int32 and tokens.starts.tolist() == [0, 7, 9]
    assert tokens.document_lengths().tolist() == [7, 2, 12] and tokens.read(7, 2).tolist() == [7, 8]
    (tmp_path / "m.bin").write_bytes((tmp_path / "m.bin").read_bytes()[:-4])
    with pytest.raises(DataError, match=r"m.idx: indexes 21 tokens but .*m.bin holds 20; the two files are not a pair"):
        TokenFile.open(tmp_path / "m.bin")


def test_validation_comes_from_eval_data_or_nanogpts_val_bin(corpus, tmp_path):
    root, summary = corpus
    ids = np.arange(200, dtype=np.uint16) % 250
    for name in ("train", "val"):
        ids.tofile(tmp_path / f"{name}.bin")
        (tmp_path / f"{name}.json").write_text(json.dumps({"dtype": "uint16"}))
    np.full(200, 7, dtype=np.uint16).tofile(tmp_path / "val.bin")
    val = next(global_batches(LLAMA, "validation", DataOptions(data=tmp_path / "train.bin")))
    assert val["input_ids"].eq(7).all()  # val.bin beside train.bin
    other = next(global_batches(LLAMA, "validation", DataOptions(data=tmp_path / "train.bin",
                                                                 eval_data=root / "t.bin")))
    assert other["input_ids"][0].tolist() == TokenFile.open(root / "t.bin").read(0, 16).tolist()
    (tmp_path / "val.bin").unlink()
    with pytest.raises(DataError, match=r"train.bin: no validation split: .* pass --eval-data PATH"):
        global_batches(LLAMA, "validation", DataOptions(data=tmp_path / "train.bin"))


def test_dp_ranks_read_their_sequences_of_the_one_device_order(corpus):
    root, _ = corpus
    options = DataOptions(data=root / "t.bin")
    one = global_batches(LLAMA, options=options)
    want = [next(one)["input_ids"] for _ in range(4)]
    ranks = [open_batches(LLAMA, None, "train", d, 2, options, workers=1) for d in range(2)]
    got = [torch.cat([next(r)["input_ids"] for r in ranks]) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    file = TokenFile.open(root / "t.bin")
    rows = {tuple(file.read(i * 16, 16).tolist()) for i in range(file.starts[270] // 16)}  # the train part
    assert all(tuple(r.tolist()) in rows for b in want for r in b)
    state = ranks[1].state_dict()
    assert state["position"] == 16 and state["token_cursor"]["token_offset"] % 16 == 0
    for r in ranks:
        r.close()


def test_packed_sequences_hold_whole_documents_with_restarting_positions(corpus):
    root, _ = corpus
    options = DataOptions(data=root / "t.bin", pack=True, shuffle=False)
    file = TokenFile.open(root / "t.bin")
    lengths = file.document_lengths(0, 270)
    batches = global_batches(PACKED, options=options)
    n = batches.source.dataset.packed.sequences
    taken = [next(batches) for _ in range(-(-n // 4))]
    rows = [r for b in taken for r in zip(b["input_ids"], b["labels"], b["position_ids"], strict=True)][:n]
    segments = []
    for ids, labels, pos in rows:
        starts = (pos == 0).nonzero().flatten().tolist() + [64]
        for a, b in itertools.pairwise(starts):
            if labels[a:b].eq(IGNORE).all():
                continue  # the padding: its own positions, no targets
            assert torch.equal(pos[a:b], torch.arange(b - a))
            assert a == 0 or labels[a] == IGNORE  # not predicted from the document before it
            assert torch.equal(labels[a + 1:b], ids[a + 1:b])
            segments.append(ids[a:b].tolist())
    # one epoch: every training document once, whole (cut in 64-token pieces where longer)
    pieces = [file.read(int(s) + k, min(64, int(n) - k)).tolist()
              for s, n in zip(file.starts[:270], lengths, strict=True) for k in range(0, int(n), 64)]
    assert sorted(segments) == sorted(pieces)
    padding = batches.source.dataset.padding()
    assert padding["packed"] < 0.1 < padding["unpacked"]


def test_validation_split_is_the_held_out_documents(corpus):
    root, _ = corpus
    batch = next(global_batches(PACKED, "validation", DataOptions(data=root / "t.bin", pack=True)))
    file = TokenFile.open(root / "t.bin")
    first = file.read(int(file.starts[270]), int(file.document_lengths()[270]))
    assert batch["input_ids"][0, :len(first)].tolist() == first.tolist()


def test_bad_token_files_are_refused_before_launch(corpus, tmp_path):
    root, _ = corpus
    llama = load_model_file(LLAMA)
    short = tmp_path / "short.bin"
    np.arange(50, dtype=np.uint16).tofile(short)
    (tmp_path / "short.json").write_text('{"dtype": "uint16"}')
    with pytest.raises(DataError, match=r"short.bin .*3 sequences, fewer than one global batch of 4"):
        check_model_data(llama, options=DataOptions(data=short))
    big = tmp_path / "big.bin"
    np.full(1000, 300, dtype=np.uint16).tofile(big)
    (tmp_path / "big.json").write_text('{"dtype": "uint16"}')
    with pytest.raises(DataError, match=r"big.bin: token id 300 in the train split, but .*llama.py's model has a "
                                        r"vocabulary of 256"):
        check_model_data(llama, options=DataOptions(data=big))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    (tmp_path / "empty.json").write_text('{"dtype": "uint16"}')
    with pytest.raises(DataError, match=r"the train split is empty"):
        check_model_data(llama, options=DataOptions(data=empty))


def test_pack_is_refused_for_models_that_cannot_mask_documents(corpus, tmp_path):
    root, _ = corpus
    options = DataOptions(data=root / "t.bin", pack=True)
    with pytest.raises(DataError, match=r"--pack: .*llama.py was compiled without position_ids"):
        check_model_data(load_model_file(LLAMA), options=options)
    plain = tmp_path / "plain.py"
    plain.write_text(PACKED.read_text().replace("return LlamaForCausalLM(", "return Plain(LlamaForCausalLM(") + (
        "\n\nclass Plain(torch.nn.Module):\n    def __init__(self, inner):\n        super().__init__()\n"
        "        self.inner = inner\n\n    def forward(self, **kw):\n        return self.inner(**kw)\n"))
    plain.write_text(plain.read_text().replace('attn_implementation="sdpa"))', 'attn_implementation="sdpa")))'))
    with pytest.raises(DataError, match=r"--pack: .*plain.py: Plain is not a transformers model .*declare "
                                        r"PACKED_POSITION_IDS = True"):
        check_model_data(load_model_file(plain), options=options)
    with pytest.raises(DataError, match=r"--data .*samples/gpt.py takes inputs \['idx', 'targets'\]"):
        check_model_data(load_model_file(ROOT / "samples" / "gpt.py"), options=DataOptions(data=root / "t.bin"))


def test_data_wins_over_make_dataset_and_says_so(corpus):
    root, _ = corpus
    said = []
    check_model_data(load_model_file(ROOT / "tests" / "models" / "dataset_llama.py"),
                     options=DataOptions(data=root / "t.bin"), say=said.append)
    assert said == [f"data: --data {root / 't.bin'} is used; the model file's make_dataset() is not"]


def test_the_references_token_count_of_a_packed_batch_counts_its_targets(corpus):
    """The single-device reference weighs accumulated and evaluated batches by their counted targets; a packed batch's
    dict holds use_cache first, and the count once took its values in that order (every target counted)."""
    from fxshard.train.reference import _token_counter

    root, _ = corpus
    batch = next(global_batches(PACKED, "validation", DataOptions(data=root / "t.bin", pack=True)))
    assert list(batch)[0] != "input_ids"  # not make_inputs()'s order
    count = _token_counter(load_model_file(PACKED), 0)
    assert count(batch) == (int((batch["labels"][:, 1:] != IGNORE).sum()),)  # the shifted labels that are not -100
    assert count(batch)[0] < batch["labels"][:, 1:].numel()
