"""`fxshard data generate` and `fxshard data tokenize` write a token file `fxshard run --data` reads; bad data is a
one-line error naming the file and the fix before any process starts; `fxshard plan --data --pack` says how much
padding packing saves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import cli

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "samples" / "llama.py"
PACKED = ROOT / "tests" / "models" / "packed_llama.py"

pytestmark = pytest.mark.e2e


def _fxshard(*args, cwd=None):
    return cli(*args, timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("data-cli")
    made = _fxshard("data", "generate", root / "gen", "--documents", 200)
    assert made.returncode == 0, made.stderr
    done = _fxshard("data", "tokenize", root / "gen" / "corpus", "--tokenizer", root / "gen" / "tokenizer", "--out",
                    root / "corpus.bin", "--validation", 0.05)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert "in 200 documents, the last 10 the validation split; eos id 0, vocabulary 256" in said
    return root


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    compile_model(LLAMA, Layout(tp=2), out=folder, meta=True)
    return folder


def test_tokenize_writes_the_bin_its_index_and_sidecar(tokens):
    side = json.loads((tokens / "corpus.json").read_text())
    assert side["dtype"] == "uint16" and side["documents"] == 200 and side["validation_documents"] == 10
    assert (tokens / "corpus.bin").stat().st_size == 2 * side["tokens"]
    assert (tokens / "corpus.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"


@pytest.mark.parametrize("make, says", [
    ("ids", "short.bin: token id 300 in the train split, but {model}'s model has a vocabulary of 256"),
    ("short", "short.bin ({split}): 2 sequences, fewer than one global batch of 4; give a longer token file"),
    ("nosidecar", "short.bin: no sidecar gives the dtype of its token ids; write {tmp}/short.json"),
])
def test_bad_token_files_are_refused_before_launch(out, tmp_path, make, says):
    ids = np.full(100, 300) if make == "ids" else np.arange(40)
    ids.astype(np.uint16).tofile(tmp_path / "short.bin")
    if make != "nosidecar":
        (tmp_path / "short.json").write_text('{"dtype": "uint16"}')
    r = _fxshard("run", out, "--data", tmp_path / "short.bin")
    assert r.returncode == 2 and "launching" not in r.stdout, r.stdout + r.stderr
    text = " ".join(r.stderr.split())
    want = says.format(model=out / "model.py", tmp=tmp_path, split="train, sequences of 16 tokens")
    assert want in text, text


def test_pack_on_a_model_without_document_masks_is_refused_before_launch(out, tokens):
    r = _fxshard("run", out, "--data", tokens / "corpus.bin", "--pack")
    assert r.returncode == 2 and "launching" not in r.stdout
    assert "--pack: " in r.stderr and "was compiled without position_ids" in " ".join(r.stderr.split())


def test_plan_says_the_padding_packing_saves(tokens):
    r = _fxshard("plan", PACKED, "--tp", 2, "--data", tokens / "corpus.bin", "--pack")
    assert r.returncode == 0, r.stderr
    line = " ".join(r.stdout.split())
    assert "data (train): " in line and "packed sequences of 64 tokens" in line and "of the positions saved" in line


def test_the_report_says_the_padding_packing_saved(tokens, tmp_path):
    from fxshard.report.data import report_data
    from fxshard.report.render import render
    from fxshard.train.data import DataOptions
    from fxshard.train.options import RunOptions
    from fxshard.train.record import write_run_record

    compile_model(PACKED, Layout(tp=2), out=tmp_path / "packed", meta=True)
    options = RunOptions(steps=1, data=DataOptions(data=tokens / "corpus.bin", pack=True))
    write_run_record(tmp_path / "packed", options, [5.5], None)
    data = report_data(tmp_path / "packed")
    padding = data.run.data["padding"]
    assert padding["packed"] < padding["unpacked"] and not data.warnings
    page = " ".join(render(data).split())
    assert f"packing saves <b>{100 * (padding['unpacked'] - padding['packed']):.1f}%</b> of the positions" in page


CHAT = ROOT / "tests" / "models" / "chat_llama.py"


def test_generate_chat_tokenize_with_a_mask_and_run(tmp_path):
    """The path a fine-tune takes with no download: generated conversations and a tokenizer with a chat
    template, `tokenize --format chat`, `run --data --pack`; a bad row is one error line naming its line."""
    gen = tmp_path / "gen"
    made = _fxshard("data", "generate", gen, "--chat", "--documents", 120)
    assert made.returncode == 0, made.stderr
    assert "chat_template" in json.loads((gen / "tokenizer" / "tokenizer_config.json").read_text())
    done = _fxshard("data", "tokenize", gen / "corpus", "--format", "chat", "--tokenizer", gen / "tokenizer",
                    "--out", tmp_path / "chat.bin", "--seq", 128, "--truncate", "drop", "--validation", 0.1)
    said = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stderr
    assert "masked by prefix renderings" in said and "dropped at --seq 128" in said, said
    tokens = json.loads((tmp_path / "chat.json").read_text())["tokens"]
    assert (tmp_path / "chat.mask").stat().st_size == tokens
    compile_model(CHAT, Layout(), out=tmp_path / "out")
    ran = _fxshard("run", tmp_path / "out", "--steps", 2, "--data", tmp_path / "chat.bin", "--pack",
                   "--data-workers", 0)
    assert ran.returncode == 0, ran.stderr
    said = " ".join(ran.stdout.split())
    assert "conversations with their loss mask, packed in sequences of 128 tokens" in said
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no messages"}) + "\n")
    bad = _fxshard("data", "tokenize", tmp_path / "bad.jsonl", "--format", "chat", "--tokenizer",
                   gen / "tokenizer", "--out", tmp_path / "bad.bin")
    said = " ".join(bad.stderr.split())
    assert bad.returncode != 0 and f"error: {tmp_path}/bad.jsonl:1: no 'messages'" in said
    assert "Traceback" not in bad.stderr
    plain = _fxshard("data", "tokenize", tmp_path / "bad.jsonl", "--tokenizer", gen / "tokenizer",
                     "--out", tmp_path / "p.bin", "--seq", 64)
    said = " ".join(plain.stderr.split())
    assert plain.returncode != 0 and "--seq, --truncate, --train-on and --chat-template go with" in said
