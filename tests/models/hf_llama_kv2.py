"""LlamaForCausalLM with 8 query heads and 2 key/value heads: at tp=4 each key/value head is held by two ranks (its
k/v projection slice replicated over them, their gradients summed once per layer)."""

from transformers import LlamaConfig, LlamaForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return LlamaForCausalLM(without_dropout(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(128, pad=0)
