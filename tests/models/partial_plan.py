"""Three MLPs under a plan the model ships (``_tp_plan``, as a Hugging Face model does) that names two of them: the
first replicated (``fc_in`` named, so its pair is not made and ``fc_out`` stays whole too), the second split as the
plan says; automatic pairing splits the third, which the plan leaves out (fxshard/plan/auto.py complete_plan)."""

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc_out(torch.relu(self.fc_in(x)))


class Model(nn.Module):
    _tp_plan = {"mlp_a.fc_in": "replicate", "mlp_b.fc_in": "colwise", "mlp_b.fc_out": "rowwise"}

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp_a, self.mlp_b, self.mlp_c = MLP(), MLP(), MLP()

    def forward(self, x):
        x = self.norm(x)
        return self.mlp_c(self.mlp_b(self.mlp_a(x) + x) + x)


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
