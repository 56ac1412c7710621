"""SwitchTransformersForConditionalGeneration: an encoder-decoder whose feed-forward layers are top-1 routed experts
with a capacity, run by a Python loop over the experts that received tokens (`for expert_idx in expert_hit`, each chosen
by `f"expert_{expert_idx[0]}"`: specialized at capture behind runtime guards); the router converts itself to float32 in
every forward. Tiny config, 4 experts, dropout 0."""

from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

from fxshard.testing import seq2seq_batch, without_dropout


def make_model():
    config = SwitchTransformersConfig(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                      num_heads=4, num_experts=4, expert_capacity=64, encoder_sparse_step=1,
                                      decoder_sparse_step=1, router_jitter_noise=0.0, pad_token_id=0,
                                      decoder_start_token_id=0)
    return SwitchTransformersForConditionalGeneration(without_dropout(config))


def make_inputs():
    return seq2seq_batch(256, 0)
