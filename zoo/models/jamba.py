"""JambaForCausalLM: a hybrid of Mamba-1 mixers and attention, with mixture-of-experts MLPs (top-2 of 4) in every other
layer. Tiny config, dropout 0, a right-padded batch with its mask and a pad token in it."""

from transformers import JambaConfig, JambaForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return JambaForCausalLM(without_dropout(JambaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, pad_token_id=0, use_cache=False,
        attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
