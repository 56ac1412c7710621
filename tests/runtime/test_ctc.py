"""``torch.ops.fxshard.ctc_loss`` (fxshard/runtime/ctc.py): the loss and gradient of ``F.ctc_loss`` on the same
inputs, with a result whose shape fake tensors know (``aten._ctc_loss`` sizes its outputs by the data)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import fxshard.runtime  # noqa: F401  registers the op


def _batch():
    torch.manual_seed(0)
    logits = torch.randn(12, 3, 6, requires_grad=True)  # time, batch, classes
    targets = torch.tensor([1, 2, 3, 4, 5, 1, 2])
    return logits, targets, torch.tensor([12, 10, 7]), torch.tensor([3, 2, 2])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_and_gradient_are_f_ctc_losss(reduction):
    logits, targets, input_lengths, target_lengths = _batch()
    expected = F.ctc_loss(logits.log_softmax(2), targets, input_lengths, target_lengths, 0, reduction)
    (want,) = torch.autograd.grad(expected.sum(), logits)
    found = torch.ops.fxshard.ctc_loss(logits.log_softmax(2), targets, input_lengths, target_lengths, 0, reduction,
                                       False)
    (got,) = torch.autograd.grad(found.sum(), logits)
    assert torch.equal(found, expected) and torch.equal(got, want)


def test_its_shape_is_known_on_fake_tensors_with_targets_sized_by_the_data():
    logits, targets, input_lengths, target_lengths = _batch()
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        labels = torch.tensor([[1, 2, 3], [4, 5, -100], [1, 2, -100]])
        flat = labels.masked_select(labels >= 0)  # a size only the data decides
        loss = torch.ops.fxshard.ctc_loss(logits.detach().log_softmax(2), flat, input_lengths, target_lengths, 0,
                                          "none", False)
    assert tuple(loss.shape) == (3,)
