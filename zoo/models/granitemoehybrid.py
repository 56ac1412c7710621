"""GraniteMoeHybridForCausalLM (Granite 4 hybrid): one decoder-layer class whose layers hold either a Mamba-2 mixer
(layer 0) or attention (layer 1), each with mixture-of-experts MLPs (top-2 of 4) and a shared MLP; its shipped plan
names only the experts. Tiny config, dropout 0, a right-padded batch with its mask and a pad token in it."""

from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return GraniteMoeHybridForCausalLM(without_dropout(GraniteMoeHybridConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, layer_types=["linear_attention", "attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, use_cache=False, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
