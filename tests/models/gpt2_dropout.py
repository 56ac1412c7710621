"""Hugging Face ``GPT2LMHeadModel`` with dropout on: embedding, attention probabilities, residual and MLP
(p = 0.1 each).  Eager attention, so the attention dropout is an ordinary ``F.dropout`` on the
[batch, heads, seq, seq] probabilities (split by heads under tensor parallelism)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, SEQ = 4, 16
P = 0.1


def config(p: float = P):
    return GPT2Config(
        vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )


def make_model():
    return GPT2LMHeadModel(config())


def make_inputs():
    ids = torch.randint(0, 256, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
