"""CLIPModel: a vision tower (patch convolution, class token, pre-LayerNorm) and a text tower (causal, pooled at the
end-of-text token), projected and compared by a contrastive loss over the whole batch (image-text logits, a learned
temperature). Tiny config, dropout 0; text rows right-padded."""

import torch
from transformers import CLIPConfig, CLIPModel

from fxshard.testing import padded_batch


def make_model():
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(image_size=24, patch_size=8, num_channels=3, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32, attn_implementation="sdpa"))


def make_inputs():
    ids, mask = padded_batch(256, 0, first_id=3)
    ids[torch.arange(4), mask.sum(1) - 1] = 2  # each row ends in end-of-text, where the text tower pools
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(4, 3, 24, 24), "return_loss": True}
