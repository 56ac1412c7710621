"""GPT2LMHeadModel: Conv1D, fused qkv, tied head. Tiny config, dropout 0, a right-padded batch with its mask and a pad
token in it."""

from transformers import GPT2Config, GPT2LMHeadModel

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return GPT2LMHeadModel(without_dropout(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                      pad_token_id=0, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
