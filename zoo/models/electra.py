"""ElectraForMaskedLM: an encoder whose embeddings (32 wide) are projected up to the hidden size (64), the generator's
masked LM head projected back down. Tiny config, dropout 0, a right-padded batch with its mask and a pad token in it."""

from transformers import ElectraConfig, ElectraForMaskedLM

from fxshard.testing import masked_lm_batch, without_dropout


def make_model():
    return ElectraForMaskedLM(without_dropout(ElectraConfig(vocab_size=256, embedding_size=32, hidden_size=64,
                                                            intermediate_size=128, num_hidden_layers=2,
                                                            num_attention_heads=4, max_position_embeddings=64,
                                                            pad_token_id=0, attn_implementation="sdpa")))


def make_inputs():
    return masked_lm_batch(256, pad=0, mask_id=3)
