"""FalconForCausalLM: multi-query attention, lifted constants. Tiny config, dropout 0, a right-padded batch with its
mask and a pad token in it."""

from transformers import FalconConfig, FalconForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return FalconForCausalLM(without_dropout(FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                          num_attention_heads=4, pad_token_id=0,
                                                          attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
