"""AlbertForMaskedLM: one encoder layer, shared, called 4 times; a pipeline cut falls between its calls and both
stages hold its weights (their gradients summed, as a tied embedding's)."""

from transformers import AlbertConfig, AlbertForMaskedLM

from fxshard.testing import masked_lm_batch, without_dropout


def make_model():
    return AlbertForMaskedLM(without_dropout(AlbertConfig(
        vocab_size=128, embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))


def make_inputs():
    return masked_lm_batch(128, pad=0, mask_id=3)
