"""FalconH1ForCausalLM: attention and a Mamba-2 mixer side by side in every layer, with its muP multipliers. Tiny
config, dropout 0, a right-padded batch with its mask and a pad token in it."""

from transformers import FalconH1Config, FalconH1ForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return FalconH1ForCausalLM(without_dropout(FalconH1Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, pad_token_id=0,
        use_cache=False, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=0)
