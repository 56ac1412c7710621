"""Hugging Face ``T5ForConditionalGeneration`` from a tiny config: ``_shift_right`` builds the decoder's
inputs from the labels with a tensor made in forward, which torch.export lifts as a constant."""

import torch
from transformers import T5Config, T5ForConditionalGeneration

BATCH, SRC, TGT, VOCAB = 4, 12, 8, 128


def make_model():
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def make_inputs():
    ids = torch.randint(1, VOCAB, (BATCH, SRC))
    labels = torch.randint(1, VOCAB, (BATCH, TGT))
    return {"input_ids": ids, "labels": labels, "use_cache": False}
