"""DbrxForCausalLM: fused q/k/v clipped to a range, and experts stored as one fused weight each (w1, v1, w2), run by a
Python loop over the experts that received tokens (`for expert_idx in expert_hit`: specialized at capture behind runtime
guards). Tiny config (top-2 of 4 experts, 2 key/value heads), a right-padded batch."""

from transformers import DbrxConfig, DbrxForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    # transformers 5 reads attn_config.rope_theta, which its DbrxAttentionConfig does not default
    config = DbrxConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}, pad_token_id=0)
    return DbrxForCausalLM(without_dropout(config))


def make_inputs():
    return causal_lm_batch(256, 0)
