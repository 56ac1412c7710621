"""A batch norm with ``momentum=None`` (a cumulative average, its factor read as a Python number from
``num_batches_tracked`` each step) is refused before capture, naming the module and the fix
(fxshard/capture/batch_norm.py); with a float momentum the same model compiles."""

from __future__ import annotations

import pytest

from fxshard.driver import compile as compile_model
from fxshard.errors import ModelFileError
from fxshard.ir.context import Layout

MODEL = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16, momentum={momentum})
        self.down = nn.Linear(16, 5)

    def forward(self, x, labels):
        return F.cross_entropy(self.down(F.relu(self.bn(self.up(x)))), labels)


def make_model():
    return Model()


def make_inputs():
    return {{"x": torch.randn(8, 6), "labels": torch.randint(0, 5, (8,))}}
"""


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2)], ids=["one-device", "tp2"])
def test_a_cumulative_batch_norm_is_refused_naming_the_module_and_the_fix(tmp_path, layout):
    (tmp_path / "model.py").write_text(MODEL.format(momentum=None))
    # before: "data-dependent control flow" at the line calling the model, naming no module
    with pytest.raises(ModelFileError, match=r"bn: BatchNorm1d\(momentum=None\) keeps a cumulative average .* "
                                             r"give it a float momentum \(BatchNorm1d\(16, momentum=0.1\)"):
        compile_model(tmp_path / "model.py", layout)


def test_a_float_momentum_compiles(tmp_path):
    (tmp_path / "model.py").write_text(MODEL.format(momentum=0.1))
    assert compile_model(tmp_path / "model.py", Layout(tp=2)).files
