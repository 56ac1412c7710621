"""benchmarks/megatron_memory.py restates Megatron-LM's theoretical memory: its layer is Korthikanti et al.'s GPT
layer, its parameter count transformers' Llama's (but for the norms' biases it counts), its optimizer bytes the
distributed optimizer's, and its in-flight microbatches the ones torch's interleaved schedule keeps alive."""

from __future__ import annotations

import pytest
import torch

from benchmarks.megatron_memory import (
    MegatronConfig,
    activation_bytes,
    bytes_per_parameter,
    from_llama,
    layer_activation_bytes,
    layer_parameters,
    theoretical_memory,
)
from fxshard.cost.alive import alive_counts
from fxshard.ir.layout import Layout


def test_a_gpt_layer_keeps_34_sbh_over_t():
    """Korthikanti et al. 2022, Table 2, sequence parallelism + selective recompute: 34·s·b·h/t bytes a layer."""
    cfg = MegatronConfig(layers=4, hidden=1024, ffn=4096, heads=16, groups=16, vocab=50304, tp=4, seq=2048,
                         micro_batch=2)
    assert layer_activation_bytes(cfg) == 34 * 2048 * 2 * 1024 / 4


def test_its_parameters_are_transformers_llamas_but_for_the_norm_biases():
    """With SwiGLU counted, the formula's layers and untied embeddings are LlamaForCausalLM's parameters, plus an
    h of bias for each of a layer's two norms and the final one (it counts LayerNorm's, RMSNorm has none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2)
    with torch.device("meta"):
        real = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    cfg = from_llama(config, Layout(), seq=16, micro_batch=1)
    assert cfg.padded_vocab == 1024 and cfg.untie_embeddings
    formula = layer_parameters(cfg) + 2 * cfg.hidden * cfg.padded_vocab
    assert formula - real == pytest.approx(3 * 2 * 256 + 256)


def test_the_distributed_optimizer_shards_12_of_18_bytes():
    cfg = MegatronConfig(layers=2, hidden=64, ffn=256, heads=4, groups=4, vocab=128, dp=8)
    assert bytes_per_parameter(cfg) == 6 + 12 / 8
    assert bytes_per_parameter(MegatronConfig(**{**cfg.__dict__, "distributed_optimizer": False})) == 18
    memory = theoretical_memory(cfg)
    assert memory["total"] == memory["weights_and_optimizer"] + memory["activations"]


@pytest.mark.parametrize("pp,v,m", [(8, 5, 64), (8, 8, 64), (4, 2, 16)])
def test_its_in_flight_microbatches_are_those_torchs_interleaved_order_keeps(pp, v, m):
    """Megatron's first pipeline rank holds ``1 + (pp-1)/(pp·v)`` times every layer's activations; torch's
    interleaved 1F1B (fxshard.cost.alive) keeps as many stage-microbatches alive, a layer to a stage here."""
    chunks = max(sum(combo.values()) for combo in alive_counts("interleaved-1f1b", pp, m, v)[0])
    cfg = MegatronConfig(layers=pp * v, hidden=64, ffn=256, heads=4, groups=4, vocab=128, pp=pp, vp=v)
    deeper = MegatronConfig(**{**cfg.__dict__, "layers": 2 * pp * v})
    per_layer = (activation_bytes(deeper, m) - activation_bytes(cfg, m)) / (pp * v * layer_activation_bytes(cfg))
    assert chunks == pytest.approx(pp * v * per_layer)
