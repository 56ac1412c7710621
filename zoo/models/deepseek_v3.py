"""DeepseekV3ForCausalLM: multi-head latent attention, shared and routed experts. Tiny config, dropout 0, a right-padded
batch with its mask and a pad token in it."""

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    config = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")
    return DeepseekV3ForCausalLM(without_dropout(config))


def make_inputs():
    return causal_lm_batch(256, pad=0)
