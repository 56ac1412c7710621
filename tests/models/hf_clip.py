"""Hugging Face ``CLIPModel`` from a tiny config: separate key projections with biases, whose gradient is zero in exact
arithmetic (softmax ignores a shift that every key shares), and a contrastive loss over the whole batch."""

import torch
from transformers import CLIPConfig, CLIPModel

from fxshard.testing import padded_batch


def make_model():
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(image_size=16, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=4)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, attn_implementation="sdpa"))


def make_inputs():
    ids, mask = padded_batch(128, 0, seq=8, lengths=(8, 3, 6, 5), first_id=3)
    ids[torch.arange(4), mask.sum(1) - 1] = 2  # each row ends in end-of-text, where the text tower pools
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(4, 3, 16, 16), "return_loss": True}
