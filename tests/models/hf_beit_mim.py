"""Hugging Face ``BeitForMaskedImageModeling`` from a tiny config: masked image modelling, whose ``labels`` hold a
visual token for each masked patch only (``[N_masked]``, in row-major order of ``bool_masked_pos`` ``[B, P]``), so
they do not lead with the batch: the loss is ``cross_entropy(scores[bool_masked_pos], labels)``."""

import torch
from transformers import BeitConfig, BeitForMaskedImageModeling

PATCHES, VOCAB = 4, 32


def make_model():
    return BeitForMaskedImageModeling(BeitConfig(
        vocab_size=VOCAB, image_size=16, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, use_mask_token=True, drop_path_rate=0.0,
        attn_implementation="sdpa"))


def make_inputs():
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    return {"pixel_values": torch.randn(4, 3, 16, 16), "bool_masked_pos": mask,
            "labels": torch.randint(0, VOCAB, (int(mask.sum()),))}
