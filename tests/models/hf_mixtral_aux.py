"""Hugging Face ``MixtralForCausalLM`` (tiny) with its load-balancing loss in the loss (``output_router_logits``):
the auxiliary loss is E * sum_e(fraction of the batch's tokens routed to e * mean router probability of e), a
product of two means over the whole batch."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

BATCH, SEQ, VOCAB = 4, 8, 128


def make_model():
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=32, router_jitter_noise=0.0,
                           output_router_logits=True, router_aux_loss_coef=0.5, attn_implementation="sdpa")
    return MixtralForCausalLM(config)


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
