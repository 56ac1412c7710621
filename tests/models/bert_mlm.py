"""BertForMaskedLM: padded rows, and labels -100 except at the masked positions (a few per row, unevenly)."""

import torch
from transformers import BertConfig, BertForMaskedLM

SEQ, PAD, MASK = 16, 0, 3
LENGTHS = (16, 9, 4, 13)
MASKED = (5, 1, 0, 3)  # masked positions per row: the third row counts no token at all


def make_model():
    return BertForMaskedLM(BertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=PAD, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def make_inputs():
    ids = torch.randint(4, 128, (len(LENGTHS), SEQ))
    mask = torch.zeros(len(LENGTHS), SEQ, dtype=torch.long)
    labels = torch.full((len(LENGTHS), SEQ), -100)
    for row, (n, k) in enumerate(zip(LENGTHS, MASKED, strict=True)):
        mask[row, :n] = 1
        where = torch.randperm(n)[:k]
        labels[row, where] = ids[row, where]
        ids[row, where] = MASK
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
