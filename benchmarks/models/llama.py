"""samples/llama.py's ``LlamaForCausalLM`` at a benchmark's size: ``1b`` (TinyLlama 1.1B's shape: 22 layers of 2048,
SwiGLU 5632, 32 heads over 4 key/value heads, vocabulary 32000) at sequence 2048, ``1b-8l`` and ``8b-4l`` (fewer
layers: benchmarks/fp8.py), or ``tiny`` for a rehearsal on the CPU.  The size comes from the environment so the file
stays a model file::

    FXSHARD_BENCH_SIZE=1b fxshard compile benchmarks/models/llama.py --dtype bf16 --meta --out out/llama-1b
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch

SIZES = {  # name -> LlamaConfig entries over samples/llama.py's, and the batch
    "tiny": dict(config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64),
                 batch=2, seq=64),
    "1b": dict(config=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
               batch=4, seq=2048),
    # benchmarks/fp8.py: the 1B shape and Llama 3 8B's (vocabulary 128256, 4096 wide, SwiGLU 14336, 32 heads over 8
    # key/value heads) with fewer layers, so bf16 and fp8 weight sets fit one GPU together and compile in seconds
    "1b-8l": dict(config=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                              num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
                  batch=4, seq=2048),
    "8b-4l": dict(config=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
                  batch=2, seq=4096),
}


def size() -> dict:
    return SIZES[os.environ.get("FXSHARD_BENCH_SIZE", "1b")]


def _sample():
    """samples/llama.py, loaded by path, registered as an imported module is (torch.compile looks it up by name)."""
    path = Path(__file__).resolve().parents[2] / "samples" / "llama.py"
    spec = importlib.util.spec_from_file_location("fxshard_sample_llama", path)
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


def config():
    config = _sample().config()
    config.update(size()["config"])
    # LlamaConfig fixed head_dim (hidden / heads) when samples/llama.py built it: the new sizes' own, not 64 / 8
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def make_model():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config())


def make_inputs():
    s = size()
    ids = torch.randint(0, s["config"]["vocab_size"], (s["batch"], s["seq"]))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
