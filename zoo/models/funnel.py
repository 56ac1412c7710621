"""FunnelForMaskedLM: an encoder that pools the sequence between blocks (strided mean pooling of the tokens, the class
token kept apart), attention with relative positions computed per block size, and a decoder that upsamples back to full
length for the masked-LM head. Tiny config (two blocks of one layer), dropout 0; a padded masked-LM batch."""

from transformers import FunnelConfig, FunnelForMaskedLM

from fxshard.testing import masked_lm_batch, without_dropout


def make_model():
    config = FunnelConfig(vocab_size=256, block_sizes=[1, 1], num_decoder_layers=1, d_model=64, n_head=4, d_head=16,
                          d_inner=128, max_position_embeddings=64, pad_token_id=0)
    return FunnelForMaskedLM(without_dropout(config))


def make_inputs():
    return masked_lm_batch(256, pad=0, mask_id=3)
