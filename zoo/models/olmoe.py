"""OlmoeForCausalLM: a mixture of experts in every layer (top-2 of 4, no shared expert), q/k norms over the whole
projection. Tiny config, dropout 0, a right-padded batch with its mask and a pad token in it."""

from transformers import OlmoeConfig, OlmoeForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return OlmoeForCausalLM(without_dropout(OlmoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                                        max_position_embeddings=64, pad_token_id=0,
                                                        attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
