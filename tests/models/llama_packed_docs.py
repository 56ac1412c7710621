"""LlamaForCausalLM on a packed batch: each row holds several documents, position ids restarting at each, labels
-100 at each document's first token (as ``fxshard run --pack`` writes them).  From the position ids transformers
masks attention to each document; under ``--cp`` that mask, like the positions, follows the load-balanced order.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 16
DOCUMENTS = [(5, 11), (16,), (3, 7, 6), (8, 8)]  # document lengths per row


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, 256, (len(DOCUMENTS), SEQ))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}
