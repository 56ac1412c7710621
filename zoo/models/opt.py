"""OPTForCausalLM: learned positions, padding_idx. Tiny config, dropout 0, a right-padded batch with its mask and a pad
token in it."""

from transformers import OPTConfig, OPTForCausalLM

from fxshard.testing import causal_lm_batch, without_dropout


def make_model():
    return OPTForCausalLM(without_dropout(OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                    num_attention_heads=4, max_position_embeddings=64,
                                                    word_embed_proj_dim=64, pad_token_id=1,
                                                    attn_implementation="sdpa")))


def make_inputs():
    return causal_lm_batch(256, pad=1)
