"""DebertaV2ForMaskedLM: disentangled attention, content-to-position and position-to-content scores from shared relative
position embeddings with log-bucketed distances (gathered by index), and an enhanced mask decoder. Tiny config, dropout
0; a padded masked-LM batch."""

from transformers import DebertaV2Config, DebertaV2ForMaskedLM

from fxshard.testing import masked_lm_batch, without_dropout


def make_model():
    config = DebertaV2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64, relative_attention=True,
                             position_buckets=16, pos_att_type=["p2c", "c2p"], pad_token_id=0)
    return DebertaV2ForMaskedLM(without_dropout(config))


def make_inputs():
    return masked_lm_batch(256, pad=0, mask_id=3)
