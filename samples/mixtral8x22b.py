"""Mixtral-8x22B-shaped MixtralForCausalLM (56 layers of 8 experts, top-2; 141B parameters): for `fxshard plan` and
`fxshard compile --meta` only (its weights alone are 564 GB in fp32); both capture on meta tensors and allocate
nothing.  Meant for expert parallelism: `--ep 8` puts one expert of every layer on each rank of an ep group."""
import torch
from transformers import MixtralConfig, MixtralForCausalLM


def make_model():
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=65536,
        rope_theta=1000000.0, router_jitter_noise=0.0, attn_implementation="sdpa"))


def make_inputs():  # dp=8 x 8 microbatches of one sequence; `fxshard plan --seq 4096` evaluates at the real length
    ids = torch.randint(0, 32768, (64, 32))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
