"""``hf_mixtral_aux.py`` with a padded attention mask: the load-balancing loss then counts only the unmasked
tokens (transformers weights each layer's counts and probabilities by the mask and divides by its sum), and the
two dp halves of this batch count different numbers of them (13 and 14 of 16)."""

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
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 5:] = 0  # right padding: 3 tokens of example 1, 2 of example 2 are not counted
    mask[2, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone(), "use_cache": False}
