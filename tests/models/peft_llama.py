"""``lora_llama.py``'s model wrapped by peft in the model file itself (``get_peft_model`` with a ``LoraConfig``):
compiled with no LoRA flag, it is the same captured program as ``lora_llama.py --lora 4 --lora-alpha 8
--lora-targets q_proj,v_proj,o_proj,down_proj``."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fxshard.capture.lora import draw_adapters
from fxshard.testing import causal_lm_batch, without_dropout

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def make_model():
    model = LlamaForCausalLM(without_dropout(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    draw_adapters(model, torch.initial_seed())  # as --lora draws them: both files train the same adapters
    return model


def make_inputs():
    return causal_lm_batch(128, pad=0)
