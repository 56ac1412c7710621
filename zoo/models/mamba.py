"""MambaForCausalLM (Mamba-1, transformers' torch path: the selective scan). Tiny config, a right-padded batch with its
mask and a pad token in it. At tp=2 every mixer is split by channel: in_proj into x and z, conv1d, A_log and D by
channel, x_proj row-parallel, dt_proj column-parallel, out_proj row-parallel."""

from transformers import MambaConfig, MambaForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return MambaForCausalLM(without_dropout(MambaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4,
        time_step_rank=8, pad_token_id=0, use_cache=False)))


def make_inputs():
    return causal_lm_batch(256, pad=0)
