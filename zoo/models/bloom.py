"""BloomForCausalLM: ALiBi, fused qkv. Tiny config, dropout 0, a right-padded batch with its mask and a pad token in
it."""

from transformers import BloomConfig, BloomForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return BloomForCausalLM(without_dropout(BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4,
                                                        pad_token_id=0, attn_implementation="eager")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
