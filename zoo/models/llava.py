"""LlavaForConditionalGeneration: a vision-language model, a CLIP vision tower and a two-layer projector whose image
features replace the image tokens of a Llama's embeddings (`masked_scatter`, after a check that their counts match, a
runtime assertion the static check runs on fake tensors). Tiny config, 4 image tokens per row for 4 patches; a
right-padded batch."""

import torch
from transformers import LlavaConfig, LlavaForConditionalGeneration

from fxshard.testing import causal_lm_batch, without_dropout

IMAGE = 255


def make_model():
    text = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, projector_hidden_act="gelu",
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    return LlavaForConditionalGeneration(without_dropout(config))


def make_inputs():
    batch = causal_lm_batch(IMAGE, 0)
    batch["input_ids"][:, 1:5] = IMAGE
    batch["labels"][:, 1:5] = -100
    batch["pixel_values"] = torch.randn(4, 3, 16, 16)
    return batch
