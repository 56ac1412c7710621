"""tests/models/mlp.py, whose import plants symbolic links (``FXSHARD_TEST_PLANT="LINK=>TARGET;..."``): run's launcher
imports the model file after it has checked the files it will write, so the links appear during the run, where
an attacker's would, before a rank opens them."""

import os

import torch
import torch.nn as nn

for pair in filter(None, os.environ.get("FXSHARD_TEST_PLANT", "").split(";")):
    link, target = pair.split("=>")
    if not os.path.lexists(link):
        os.symlink(target, link)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc_out(torch.relu(self.fc_in(self.norm(x))))


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
