"""A model that steers the split with fxshard decorators (the rest of fxshard's behaviour is automatic).

The class decorator names children relative to the module; ``fxshard.parallelize`` can also be
called on an instance inside ``make_model``.

    fxshard compile samples/annotated.py --tp 2 --out out/annotated
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard

HIDDEN, FFN, LAYERS, BATCH, SEQ = 32, 128, 2, 4, 8


@fxshard.parallelize(up=fxshard.colwise(), gate=fxshard.colwise(), down=fxshard.rowwise())
class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.gate = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=True)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(LAYERS))
        self.mlps = nn.ModuleList(GatedMLP() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        for norm, mlp in zip(self.norms, self.mlps, strict=False):
            x = x + mlp(norm(x))
        return F.mse_loss(self.head(x).squeeze(-1), y)


def make_model():
    model = Net()
    # instance-level annotation: keep the regression head whole on every rank
    fxshard.parallelize(model, head=fxshard.replicate())
    return model


def make_inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ))
