"""Qwen3NextForCausalLM: Gated DeltaNet linear attention (layer 0) and gated full attention (layer 1), with
mixture-of-experts MLPs (top-2 of 4) and a shared expert. Tiny config, the torch path, dropout 0, a right-padded batch
with its mask and a pad token in it."""

from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return Qwen3NextForCausalLM(without_dropout(Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, layer_types=["linear_attention",
                                                                                     "full_attention"],
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        pad_token_id=0, use_cache=False, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
