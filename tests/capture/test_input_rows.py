"""Inputs that do not lead with the batch (fxshard/capture/rows.py): a masked-image-modelling head's ``labels`` hold
an entry per masked position (``[N_masked]`` beside ``bool_masked_pos`` ``[B, P]``).  Taken as they are where nothing
splits the batch; under --dp and pipeline microbatches each part takes its rows' entries, every part holding as many
(shapes are fixed at compile); refused by name otherwise.  Training against one device (BEiT at tp2, dp2, pp2 and
tp2·dp2) is in tests/test_training_layouts.py (beit-mim-*)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.capture.program import capture
from fxshard.capture.rows import Rows, check_entries, paired_with_masks
from fxshard.driver import compile as compile_model
from fxshard.errors import DataError, FxshardError, LayoutError
from fxshard.ir.context import Layout
from fxshard.train.data import open_batches
from fxshard.train.data.spec import local_slice

BEIT = Path(__file__).resolve().parents[1] / "models" / "hf_beit_mim.py"
MASK = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)  # 2, 2, 3, 1


def _batch(mask=MASK):
    return {"pixels": torch.randn(4, 3), "mask": mask, "labels": torch.arange(int(mask.sum()))}


def test_a_counted_input_splits_by_its_masks_rows():
    rows = Rows.of(_batch())
    assert (rows.batch, rows.counted, rows.whole) == (4, {"labels": "mask"}, ())
    second = local_slice(_batch(), 1, 2, rows)  # rows 2 and 3: 3 + 1 of the 8 entries, after rows 0 and 1's 4
    assert second["labels"].tolist() == [4, 5, 6, 7] and second["pixels"].shape == (2, 3)
    assert rows.take(_batch(), 3, 4)["labels"].tolist() == [7]
    assert rows.part_sizes(_batch(), 4) == {"labels": [2, 2, 3, 1]}


def test_an_input_neither_leading_nor_counted_is_whole():
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,)), "weights": torch.ones(2)}
    rows = Rows.of(batch)
    assert (rows.batch, rows.counted, rows.whole) == (4, {}, ("weights",))
    assert rows.take(batch, 0, 2)["weights"].shape == (2,)


def test_the_graph_pairs_the_labels_with_the_mask_they_follow():
    program = capture(load_model_file(BEIT))
    assert paired_with_masks(program.gm, program.inputs) == {"labels": "bool_masked_pos"}


def test_no_split_takes_the_labels_as_they_are():
    # refused before, at tp2: "the tensors' first dimensions differ ([4, 8])"
    result = compile_model(BEIT, Layout(tp=2))
    labels = next(i for i in result.manifest.inputs if i.name == "labels")
    assert (labels.shape, labels.counted_by) == ((8,), "bool_masked_pos")
    batch = next(open_batches(BEIT, result.manifest))
    assert batch["labels"].shape == (8,)


def test_dp_takes_each_ranks_rows_entries():
    result = compile_model(BEIT, Layout(dp=2))
    labels = next(i for i in result.manifest.inputs if i.name == "labels")
    assert (labels.shape, labels.microbatch_shape) == ((8,), (4,))  # rows 0-1 and 2-3 mask 4 positions each
    full = load_model_file(BEIT).build_inputs()
    second = next(open_batches(BEIT, result.manifest, dp_rank=1, dp_size=2))
    assert torch.equal(second["labels"], full["labels"][4:]) and torch.equal(second["bool_masked_pos"], MASK[2:])


def test_parts_holding_different_counts_are_refused_naming_the_input():
    # 4 microbatches of one row mask 2, 2, 3 and 1 positions: the compiled program has one shape for all
    with pytest.raises(LayoutError, match=r"input 'labels' holds an entry per True position of 'bool_masked_pos', "
                                          r"and the 4 parts of 1 row that 4 microbatches make hold \[2, 2, 3, 1\]"):
        compile_model(BEIT, Layout(pp=2, microbatches=4))


def test_a_batch_whose_parts_hold_other_counts_is_refused_at_run():
    specs = compile_model(BEIT, Layout(dp=2)).manifest.inputs
    mine = Rows.of_inputs(specs)
    other = MASK.clone()
    other[0, 1] = True  # rows 0-1 now mask 5 positions; the program takes 4
    batch = local_slice({"pixel_values": torch.randn(4, 3, 16, 16), "bool_masked_pos": other,
                         "labels": torch.arange(9)}, 0, 2, mine)
    leaves = [batch[i.name] for i in specs]
    with pytest.raises(FxshardError, match=r"labels holds an entry per True position of bool_masked_pos, and the "
                                           r"program was compiled for 4 per run of 2 rows .* hold \[5\]"):
        check_entries(specs, leaves)


def test_an_uncounted_input_is_refused_under_dp_naming_it(tmp_path):
    (tmp_path / "model.py").write_text(WEIGHTED)
    compile_model(tmp_path / "model.py", Layout(tp=2))  # nothing splits the batch: taken whole
    with pytest.raises(LayoutError, match=r"input 'weights' has shape \[5\], whose first dimension is not the batch "
                                          r"of 4, and no boolean input"):
        compile_model(tmp_path / "model.py", Layout(dp=2))


def test_a_dataset_cannot_hold_a_counted_input(tmp_path):
    (tmp_path / "model.py").write_text(BEIT.read_text() + DATASET)
    with pytest.raises(DataError, match=r"input 'labels' of make_inputs\(\) does not lead with the batch \(an entry "
                                        r"per True position of 'bool_masked_pos'\)"):
        next(open_batches(tmp_path / "model.py"))


WEIGHTED = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 5)

    def forward(self, x, labels, weights):  # class weights as an input: no batch dimension
        return F.cross_entropy(self.head(x), labels, weight=weights)


def make_model():
    return Weighted()


def make_inputs():
    return {"x": torch.randn(4, 3), "labels": torch.randint(0, 5, (4,)), "weights": torch.rand(5)}
"""

DATASET = """

def make_dataset(split):
    return [{"pixel_values": torch.randn(3, 16, 16), "bool_masked_pos": torch.ones(4, dtype=torch.bool),
             "labels": torch.zeros(4, dtype=torch.long)}]
"""
