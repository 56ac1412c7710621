"""Mamba2ForCausalLM (transformers' torch path: the chunked scan): a tensor-parallel split of every mixer by heads:
in_proj packed as z, x, B, C, dt (B and C by group: two groups), conv1d by channel, A_log, D and
dt_bias by head, the gated norm local to its groups, out_proj row-parallel."""

from transformers import Mamba2Config, Mamba2ForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return Mamba2ForCausalLM(without_dropout(Mamba2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, head_dim=8, num_heads=8,
        n_groups=2, chunk_size=8, conv_kernel=4, pad_token_id=0, use_cache=False)))


def make_inputs():
    return causal_lm_batch(128, pad=0)
