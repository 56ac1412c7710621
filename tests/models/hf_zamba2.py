"""Zamba2ForCausalLM: a ModuleList of two classes (Mamba2 layers and hybrid layers) whose hybrid layers all call
one shared attention block; the pipeline cuts between layers of either class and every stage calling the shared
block holds its weights."""

from transformers import Zamba2Config, Zamba2ForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return Zamba2ForCausalLM(without_dropout(Zamba2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_mem_blocks=1, num_attention_heads=4, num_key_value_heads=4, attention_head_dim=8, mamba_d_state=8,
        mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1, intermediate_size=64, use_shared_attention_adapter=False,
        use_mem_rope=False, max_position_embeddings=64, pad_token_id=0, use_cache=False)))


def make_inputs():
    return causal_lm_batch(128, pad=0)
