"""An MLP whose loss stays finite while one batch makes a gradient NaN (issue 32 item 4): ``0 * sqrt(w * w * g)``
adds nothing to the output, but where ``g`` is 0 its gradient is ``0 * inf``.  The third of four batches has
``g = 0`` in its last row only, so under dp=2 only dp rank 1's gradient is NaN before the ranks exchange theirs.
``FXSHARD_TEST_POISON=0`` leaves that batch out: the run that a skipped step must equal."""

import os

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x, gate):
        y = self.fc_out(torch.relu(self.fc_in(self.norm(x))))
        return y + torch.sqrt(self.norm.weight * self.norm.weight * gate.min()).sum() * 0.0


def make_model():
    return Model()


def make_inputs():
    return torch.randn(4, 16), torch.ones(4, 1)


def make_batches():
    batches = [make_inputs() for _ in range(4)]
    batches[2][1][3] = 0.0  # the poisoned row: the last, dp rank 1's under dp=2
    if os.environ.get("FXSHARD_TEST_POISON") == "0":
        del batches[2]
    return batches


def loss_fn(out, inputs):
    return out.pow(2).mean()
