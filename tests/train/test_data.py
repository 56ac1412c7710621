"""fxshard.train.data: every dp layout reads the global batches one device reads, each rank only its rows; the data
position resumes at the next example under any dp; examples unlike the compiled row are refused by name."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.errors import DataError
from fxshard.train.data import global_batches, open_batches
from fxshard.train.data.order import EpochOrder

MODELS = Path(__file__).resolve().parent.parent / "models"
DATASET = MODELS / "dataset_llama.py"


@functools.cache
def _table() -> dict:
    module = load_model_file(DATASET).module
    return {tuple(module.row("train", i)["input_ids"].tolist()): i for i in range(module.ROWS["train"])}


def _rows(batch) -> list[int]:
    """Which dataset rows a batch holds (dataset_llama's rows are distinct)."""
    return [_table()[tuple(r.tolist())] for r in batch["input_ids"]]


def _joined(dp: int, steps: int, workers: int, state=None) -> list[list[int]]:
    ranks = [open_batches(DATASET, None, "train", d, dp, state=state, workers=workers) for d in range(dp)]
    try:
        return [sum((_rows(next(r)) for r in ranks), []) for _ in range(steps)]
    finally:
        for r in ranks:
            r.close()


@pytest.mark.parametrize("dp,workers", [(2, 0), (4, 2)])
def test_dp_ranks_read_the_global_batches_of_one_device(dp, workers):
    one = global_batches(DATASET)
    want = [_rows(next(one)) for _ in range(12)]  # 48 rows of a 22-row dataset: three epochs, batches straddling
    assert _joined(dp, 12, workers) == want
    flat = sum(want, [])
    for epoch in range(2):  # each epoch every row once, in a new order
        assert sorted(flat[22 * epoch:22 * (epoch + 1)]) == list(range(22))
    assert flat[:22] != flat[22:44]


def test_a_rank_reads_only_its_rows(monkeypatch):
    mf = load_model_file(DATASET)
    read = []
    monkeypatch.setattr(mf.module.Rows, "__getitem__", lambda self, i: read.append(i) or mf.module.row("train", i))
    batches = open_batches(mf, None, "train", 1, 2, workers=0)
    got = [_rows(next(batches)) for _ in range(3)]
    assert sorted(read) == sorted(sum(got, [])) and len(read) == 6


def test_position_resumes_at_the_next_example_under_another_dp():
    first = open_batches(DATASET, None, "train", 0, 2, workers=0)
    for _ in range(5):
        next(first)
    state = first.state_dict()
    assert state["position"] == 20 and state["examples_per_dp_rank"] == 10 and state["epoch"] == 0
    import json

    state = json.loads(json.dumps(state))
    one = global_batches(DATASET)
    want = [_rows(next(one)) for _ in range(9)][5:]
    assert _joined(4, 4, 0, state) == want  # resharded from dp=2 to dp=4


def test_stream_is_split_by_rank_and_worker(monkeypatch):
    monkeypatch.setenv("STREAM", "1")
    one = global_batches(DATASET)
    want = [_rows(next(one)) for _ in range(8)]
    assert sum(want, [])[:22] == list(range(22))  # an IterableDataset's own order, epoch after epoch
    assert _joined(2, 8, 2) == want


def test_validation_split_is_in_order_and_separate():
    val = global_batches(DATASET, "validation")
    first = next(val)
    assert torch.equal(first["input_ids"][0], load_model_file(DATASET).module.row("validation", 0)["input_ids"])
    assert first["use_cache"] is False


def test_unread_inputs_are_not_loaded():
    batches = open_batches(DATASET, None, "train", 0, 2, reads={"labels"}, workers=0)
    batch = next(batches)
    assert batch["input_ids"] is None and batch["labels"].shape == (2, 16)


def test_example_unlike_the_compiled_row_is_refused(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(DATASET.read_text().replace("ids = torch.randint(0, VOCAB, (SEQ,), generator=g)",
                                               "ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)"))
    batches = open_batches(bad, None, "train", 0, 1, workers=0)
    with pytest.raises(DataError, match=r"bad.py: make_dataset\('train'\)\[\d+\]: input 'input_ids' of an example is "
                                        r"\[17\] int64; the program was compiled for rows of \[16\] int64"):
        next(batches)


def test_epoch_order_is_seeded():
    a, b = EpochOrder(100, seed=3), EpochOrder(100, seed=3)
    assert a.indices(95, 10) == b.indices(95, 10)
    assert a.indices(0, 100) != EpochOrder(100, seed=4).indices(0, 100)
    assert EpochOrder(10, shuffle=False).indices(8, 4) == [8, 9, 0, 1]
