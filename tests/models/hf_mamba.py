"""MambaForCausalLM (Mamba-1, transformers' torch path: the selective scan): a tensor-parallel split of every mixer by
channel: in_proj into x and z, conv1d by channel, x_proj row-parallel (one all-reduce of dt, B and C), dt_proj
column-parallel, A_log and D by channel, out_proj row-parallel."""

from transformers import MambaConfig, MambaForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return MambaForCausalLM(without_dropout(MambaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=4, pad_token_id=0, use_cache=False, tie_word_embeddings=False)))


def make_inputs():
    return causal_lm_batch(128, pad=0)
