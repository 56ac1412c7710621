"""GPTBigCodeForCausalLM: multi-query attention (one key/value head in a fused c_attn), learned positions. Tiny config,
dropout 0, a right-padded batch with its mask and a pad token in it."""

from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return GPTBigCodeForCausalLM(without_dropout(GPTBigCodeConfig(vocab_size=256, n_embd=64, n_inner=128, n_layer=2,
                                                                  n_head=4, n_positions=64, multi_query=True,
                                                                  pad_token_id=0, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
