"""Hugging Face ``Olmo2ForCausalLM`` from a tiny config: q/k norms over the whole projection, so its own
plan gathers q/k/v (``colwise_gather_output``) and feeds o_proj a replicated input (``rowwise_split_input``).
No pad token in the batch: the vocab-parallel lookup of a padding row is issue 13 item 3."""

import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

BATCH, SEQ, VOCAB = 4, 8, 128


def make_model():
    config = Olmo2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         pad_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return Olmo2ForCausalLM(config)


def make_inputs():
    ids = torch.randint(2, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
