"""Hugging Face ``GPT2LMHeadModel`` from a small config: ``Conv1D`` layers, fused q/k/v, tied embeddings.

GPT-2 ships no tensor-parallel plan, so fxshard plans it automatically: ``c_attn`` becomes a packed
column split (3 blocks), ``c_proj`` row-parallel, the tied ``wte``/``lm_head`` vocabulary-parallel.

    fxshard compile samples/gpt2.py --tp 2 --out out/gpt2
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, SEQ = 4, 16


def config():
    return GPT2Config(
        vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa",
    )


def make_model():
    return GPT2LMHeadModel(config())


def make_inputs():
    ids = torch.randint(0, 256, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
