"""AlbertForMaskedLM: one transformer layer's weights shared by every layer (called again at each depth, so its gradient
sums over the calls), factorized embeddings (32 wide) projected to the hidden size. Tiny config, dropout 0; a padded
masked-LM batch."""

from transformers import AlbertConfig, AlbertForMaskedLM

from fxshard.testing import masked_lm_batch, without_dropout


def make_model():
    config = AlbertConfig(vocab_size=256, embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, max_position_embeddings=64, pad_token_id=0)
    return AlbertForMaskedLM(without_dropout(config))


def make_inputs():
    return masked_lm_batch(256, pad=0, mask_id=3)
