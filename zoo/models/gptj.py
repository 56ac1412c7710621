"""GPTJForCausalLM: rotary on part of each head. Tiny config, dropout 0, a right-padded batch with its mask and a pad
token in it."""

from transformers import GPTJConfig, GPTJForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return GPTJForCausalLM(without_dropout(GPTJConfig(vocab_size=256, n_embd=64, n_inner=128, n_layer=2, n_head=4,
                                                      rotary_dim=8, n_positions=64, pad_token_id=0,
                                                      attn_implementation="eager")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
