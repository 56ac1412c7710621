"""The Llama every tool of the peers benchmark trains (``benchmarks/peers``): Hugging Face's ``LlamaForCausalLM``
(RoPE without scaling, RMSNorm, SwiGLU, grouped-query attention, untied embeddings), which fxshard compiles, and
whose weights torchtitan's ``Llama3Model`` and Megatron-Core's ``GPTModel`` load (``benchmarks/peers/weights.py``).
The size comes from the environment so the file stays a model file::

    FXSHARD_PEERS_SIZE=small fxshard compile benchmarks/models/peer_llama.py --tp 2 --out out/peer-tp2
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SIZE_VARIABLE = "FXSHARD_PEERS_SIZE"
SIZES = {  # name -> shape and batch; ffn is the SwiGLU width every tool is given as is
    "toy": dict(vocab=256, hidden=64, ffn=128, layers=2, heads=8, kv_heads=4, batch=4, seq=32),
    "small": dict(vocab=2048, hidden=256, ffn=768, layers=4, heads=8, kv_heads=4, batch=8, seq=128),
    # GPU shapes: Llama 3.2 1B's widths (untied here), and Llama 3.1 8B's widths with 4 of its 32 layers
    "1b": dict(vocab=128256, hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, batch=4, seq=2048),
    "8b-4l": dict(vocab=128256, hidden=4096, ffn=14336, layers=4, heads=32, kv_heads=8, batch=2, seq=2048),
}
ROPE_THETA = 500000.0
NORM_EPS = 1e-5


def size() -> dict:
    return SIZES[os.environ.get(SIZE_VARIABLE, "small")]


def config() -> LlamaConfig:
    s = size()
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
                       rope_theta=ROPE_THETA, rms_norm_eps=NORM_EPS, tie_word_embeddings=False,
                       attn_implementation="sdpa")


def make_model():
    return LlamaForCausalLM(config())


def make_inputs():
    s = size()
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
