"""GPTBigCodeForCausalLM with multi-query attention (one key/value head in a fused c_attn packed as q, k, v of
unequal sizes): at tp=2 the key/value head is held by both ranks, its gradients summed once per layer."""

from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return GPTBigCodeForCausalLM(without_dropout(GPTBigCodeConfig(
        vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True, pad_token_id=0,
        attn_implementation="sdpa", tie_word_embeddings=False)))


def make_inputs():
    return causal_lm_batch(128, pad=0)
