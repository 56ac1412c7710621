"""LlamaForCausalLM fine-tuned with frozen parameters (``requires_grad=False``), as fine-tuning freezes embeddings
or LoRA bases: the token embedding (split over tp by the vocabulary), the first layer's gate projection (a
column-parallel weight) and the final norm (replicated).  They get no gradient, no optimizer state and no update at
any layout or ZeRO stage, and are still loaded, saved and exported."""

from transformers import LlamaConfig, LlamaForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout

FROZEN = ("model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight", "model.norm.weight")


def make_model():
    model = LlamaForCausalLM(without_dropout(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return model


def make_inputs():
    return causal_lm_batch(128, pad=0)
