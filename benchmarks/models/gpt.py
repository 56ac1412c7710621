"""The benchmarks' GPT: the architecture of samples/gpt.py, a plain nn.Module that knows nothing of parallelism.

One file serves every contender: fxshard compiles it, DTensor parallelizes an instance of
:class:`GPT`, the hand-written Megatron version loads its weights.  The size comes from the
environment (``tiny``, ``small``, ``medium``; default ``small``) so the file stays a model file::

    FXSHARD_BENCH_SIZE=medium fxshard compile benchmarks/models/gpt.py --tp 2 --out out/bench
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch

SIZES = {  # name -> GPT keyword arguments and the batch
    "tiny": dict(vocab=128, seq=16, hidden=64, heads=4, layers=2, batch=2),
    "small": dict(vocab=1024, seq=128, hidden=256, heads=8, layers=4, batch=4),
    "medium": dict(vocab=2048, seq=128, hidden=512, heads=8, layers=4, batch=4),
}


def size() -> dict:
    return SIZES[os.environ.get("FXSHARD_BENCH_SIZE", "small")]


def _sample():
    """samples/gpt.py, loaded by path: the same architecture the README's examples compile."""
    path = Path(__file__).resolve().parents[2] / "samples" / "gpt.py"
    spec = importlib.util.spec_from_file_location("fxshard_sample_gpt", path)
    module = importlib.util.module_from_spec(spec)
    # registered, as an imported module is: torch.compile looks a function's globals' module up by name
    module = sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


_SAMPLE = _sample()


class GPT(_SAMPLE.GPT):
    """samples/gpt.py's GPT (tied LM head) returning only the loss, as the hand-written and DTensor
    contenders do."""

    def forward(self, idx, targets):
        return super().forward(idx, targets)[1]


def make_model():
    config = dict(size())
    config.pop("batch")
    return GPT(**config)


def make_inputs():
    s = size()
    data = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1))
    return {"idx": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}
