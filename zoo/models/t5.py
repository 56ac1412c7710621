"""T5ForConditionalGeneration: encoder-decoder, relative position buckets, labels shifted right in forward. Tiny config,
dropout 0, a right-padded batch with its mask and a pad token in it."""

from transformers import T5Config, T5ForConditionalGeneration

from fxshard.testing import seq2seq_batch, without_dropout


def make_model():
    return T5ForConditionalGeneration(without_dropout(T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128,
                                                               num_layers=2, num_decoder_layers=2, num_heads=4,
                                                               decoder_start_token_id=0, pad_token_id=0,
                                                               attn_implementation="eager")))


def make_inputs():
    return seq2seq_batch(256, pad=0)
