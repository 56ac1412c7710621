"""ElectraForPreTraining: the replaced-token discriminator, a binary cross entropy over the tokens the attention mask
keeps (`logits[active_loss]`, a boolean index: a size only the data decides, and a mean whose count the mask gives,
counted over the whole step under every layout). Tiny config, dropout 0; a right-padded batch with about a third of the
tokens labelled replaced."""

import torch
from transformers import ElectraConfig, ElectraForPreTraining

from fxshard.testing import padded_batch, without_dropout


def make_model():
    config = ElectraConfig(vocab_size=256, embedding_size=32, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                           attn_implementation="sdpa")
    return ElectraForPreTraining(without_dropout(config))


def make_inputs():
    ids, mask = padded_batch(256, 0, first_id=3)
    return {"input_ids": ids, "attention_mask": mask, "labels": (torch.rand(ids.shape) < 0.3).long()}
