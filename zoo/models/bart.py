"""BartForConditionalGeneration: encoder-decoder, learned positions. Tiny config, dropout 0, a right-padded batch with
its mask and a pad token in it."""

from transformers import BartConfig, BartForConditionalGeneration

from fxshard.testing import seq2seq_batch, without_dropout


def make_model():
    return BartForConditionalGeneration(without_dropout(BartConfig(vocab_size=256, d_model=64, encoder_layers=2,
                                                                   decoder_layers=2, encoder_attention_heads=4,
                                                                   decoder_attention_heads=4, encoder_ffn_dim=128,
                                                                   decoder_ffn_dim=128, max_position_embeddings=64,
                                                                   pad_token_id=1, decoder_start_token_id=2,
                                                                   forced_eos_token_id=None,
                                                                   attn_implementation="sdpa")))


def make_inputs():
    return seq2seq_batch(256, pad=1)
