"""DeepseekV3ForCausalLM (a dense first layer, then shared and routed experts) whose routers hold their
score-correction bias as a frozen parameter (``requires_grad=False``, as fine-tuning recipes keep it), not as a
buffer: it gets no gradient and no optimizer state at any ZeRO stage, and is loaded, saved and exported.  At
``--pp 2 --ep 2`` the first stage holds no experts, so it builds no expert optimizer."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    model = DeepseekV3ForCausalLM(without_dropout(DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))
    for module in model.modules():
        bias = module._buffers.pop("e_score_correction_bias", None)
        if bias is not None:  # nonzero, so a bias left at its initial zeros or updated shows in the losses
            module.e_score_correction_bias = torch.nn.Parameter(torch.randn_like(bias) * 0.1, requires_grad=False)
    return model


def make_inputs():
    return causal_lm_batch(256, pad=0)
