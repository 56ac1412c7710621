"""Hugging Face ``SiglipModel`` from a tiny config: SigLIP's pairwise sigmoid loss over the whole batch,
``logits = text @ image.T * exp(t) + bias`` against ``2 * eye(B) - 1``: each text scored against every image of the
batch, the labels a matrix made at the batch's size (``torch.eye(B)``) rather than read from the inputs."""

import torch
from transformers import SiglipConfig, SiglipModel


def make_model():
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, projection_size=32)
    vision = dict(image_size=16, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=4)
    return SiglipModel(SiglipConfig(text_config=text, vision_config=vision, attn_implementation="sdpa"))


def make_inputs():
    # SigLIP pads every text to the full length (it pools at the last position) and takes no attention mask
    return {"input_ids": torch.randint(3, 128, (4, 8)), "pixel_values": torch.randn(4, 3, 16, 16), "return_loss": True}
