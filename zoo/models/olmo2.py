"""Olmo2ForCausalLM: no pre-attention norm, q/k norms. Tiny config, dropout 0, a right-padded batch with its mask and a
pad token in it."""

from transformers import Olmo2Config, Olmo2ForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return Olmo2ForCausalLM(without_dropout(Olmo2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2, max_position_embeddings=64,
                                                        pad_token_id=0, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
