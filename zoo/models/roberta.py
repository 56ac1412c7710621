"""RobertaForMaskedLM: masked LM, positions offset by the padding index. Tiny config, dropout 0, a right-padded batch
with its mask and a pad token in it."""

from transformers import RobertaConfig, RobertaForMaskedLM

from fxshard.testing import masked_lm_batch, without_dropout


def make_model():
    return RobertaForMaskedLM(without_dropout(RobertaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                            num_hidden_layers=2, num_attention_heads=4,
                                                            max_position_embeddings=64, pad_token_id=1,
                                                            attn_implementation="sdpa")))


def make_inputs():
    return masked_lm_batch(256, pad=1, mask_id=3)
