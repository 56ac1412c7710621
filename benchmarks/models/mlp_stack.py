"""A compute-heavy stack of residual MLP blocks for the pipeline benchmark: every block costs the same.

Nothing but matrix products between stages, so a stage's busy time is its compute and the
pipeline's idle time is its bubble (plus the send/receive of a small activation)::

    fxshard compile benchmarks/models/mlp_stack.py --pp 2 --schedule gpipe --microbatches 4 --out out/mlp
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, BLOCKS, BATCH = 512, 8, 128


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc_out(F.gelu(self.fc_in(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, hidden=HIDDEN, blocks=BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x, target):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), target)


def make_model():
    return MLPStack()


def make_inputs():
    return {"x": torch.randn(BATCH, HIDDEN), "target": torch.randn(BATCH, HIDDEN)}
