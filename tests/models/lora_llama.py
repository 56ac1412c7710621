"""A tiny LlamaForCausalLM for LoRA: compiled with ``--lora 4 --lora-targets ...`` (``peft_llama.py`` is the same
model wrapped by peft in the model file).  Two layers, 4 query and 2 key/value heads, vocabulary 128."""

from transformers import LlamaConfig, LlamaForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return LlamaForCausalLM(without_dropout(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(128, pad=0)
