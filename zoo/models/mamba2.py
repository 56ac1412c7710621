"""Mamba2ForCausalLM (transformers' torch path: the chunked scan). Tiny config, a right-padded batch with its mask and a
pad token in it. At tp=2 every mixer is split by heads: in_proj packed as z, x, B, C, dt (B and C by group), conv1d by
channel, A_log, D and dt_bias by head, the gated norm by group, out_proj row-parallel."""

from transformers import Mamba2Config, Mamba2ForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return Mamba2ForCausalLM(without_dropout(Mamba2Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, head_dim=16, num_heads=8,
        n_groups=2, chunk_size=8, conv_kernel=4, pad_token_id=0, use_cache=False)))


def make_inputs():
    return causal_lm_batch(256, pad=0)
