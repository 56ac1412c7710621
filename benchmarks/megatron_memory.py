"""Megatron-LM's theoretical memory per rank, as a reference for ``fxshard plan``'s per-rank estimate.

Megatron-LM prints, at the start of a run with sequence parallelism and selective recompute, the memory it expects
on its most loaded rank (``megatron/training/theoretical_memory_usage.py``, NVIDIA/Megatron-LM at commit
38644dd756c46142787b1bd5dc08ed82ca0e6de1).  This module restates that formula (our own code, the same arithmetic)
so that a recipe's per-rank figure can be set beside fxshard's for the same configuration:

- **weights and optimizer**: the parameters of the most loaded pipeline rank, ``(layers / pp + embedding) / tp``,
  times 18 bytes each, or ``6 + 12 / dp`` with the distributed optimizer (bf16 weights, fp32 gradients, fp32
  master weights and Adam moments sharded over the ``dp`` ranks: Megatron's ``data_parallel_size``, which does not
  count cp).  A layer has ``2·h²·(1 + ffn/h + groups/heads) + 2h`` parameters at 38644dd, which counts a two-matrix
  MLP; later versions of the same file (``gated_linear_multiplier``, e.g. yuzhongw-nvidia/Megatron-LM at e851e7d,
  2026) count SwiGLU's third matrix, ``swiglu=True`` here;
- **activations**: Korthikanti et al. 2022's Table 2 under sequence parallelism and selective recompute,
  ``s·b·h·(18 + 4·ffn/h)`` bytes a layer over tp, times every layer (the first pipeline rank holds ``pp``
  microbatches of its ``layers / pp``), times ``1 + (pp - 1) / (pp·vp)`` under the interleaved schedule; plus the
  embedding's input and output for ``pp`` microbatches, and at ``pp = 1`` the output layer's input and logits.
  The formula takes the whole sequence (it knows no context parallelism), a GELU MLP (4·ffn bytes a token: SwiGLU
  keeps 6) and no grouped-query attention (its k and v are counted at h).

Nothing here runs Megatron: it is the formula, evaluated::

    cfg = MegatronConfig(layers=80, hidden=8192, ffn=28672, heads=64, groups=8, vocab=128256, tp=4, pp=8, vp=5,
                         dp=2, seq=8192, micro_batch=1)
    theoretical_memory(cfg)["total"] / 2**30      # GiB on the most loaded rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SOURCE = ("Megatron-LM megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM "
          "38644dd756c46142787b1bd5dc08ed82ca0e6de1)")


@dataclass(frozen=True)
class MegatronConfig:
    """The arguments the formula reads, by Megatron's meaning (``dp``: ranks of the data-parallel group without cp;
    ``vp``: virtual pipeline stages per rank, None without interleaving)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int  # query groups (key/value heads)
    vocab: int
    tp: int = 1
    pp: int = 1
    vp: int | None = None
    dp: int = 1
    seq: int = 2048
    micro_batch: int = 1
    distributed_optimizer: bool = True
    untie_embeddings: bool = True
    swiglu: bool = False  # count SwiGLU's third MLP matrix, as later versions of the formula do
    vocab_multiple: int = 128  # --make-vocab-size-divisible-by (times tp)

    @property
    def padded_vocab(self) -> int:
        """The vocabulary Megatron pads to a multiple of ``vocab_multiple·tp``."""
        step = self.vocab_multiple * self.tp
        return math.ceil(self.vocab / step) * step


def layer_parameters(cfg: MegatronConfig) -> float:
    """Parameters of the transformer layers (all of them, and the final norm), as the formula counts them."""
    mlp = cfg.ffn / cfg.hidden * (1.5 if cfg.swiglu else 1.0)
    return 2 * cfg.layers * cfg.hidden ** 2 * (1 + mlp + cfg.groups / cfg.heads + 2 / cfg.hidden
                                               + 1 / (cfg.layers * cfg.hidden))


def most_loaded_parameters(cfg: MegatronConfig) -> float:
    """Parameters on the most loaded rank: its share of the layers, and the embedding (both tied halves when
    ``pp = 1`` and untied), over tp."""
    embedding = cfg.hidden * cfg.padded_vocab
    shard = (layer_parameters(cfg) / cfg.pp + embedding) / cfg.tp
    if cfg.untie_embeddings and cfg.pp == 1:
        shard += embedding / cfg.tp
    return shard


def bytes_per_parameter(cfg: MegatronConfig) -> float:
    """18 (bf16 weight, fp32 gradient, fp32 master weight and Adam moments), or ``6 + 12/dp`` with the distributed
    optimizer."""
    return 6 + 12 / cfg.dp if cfg.distributed_optimizer else 18


def weight_and_optimizer_bytes(cfg: MegatronConfig) -> float:
    return most_loaded_parameters(cfg) * bytes_per_parameter(cfg)


def layer_activation_bytes(cfg: MegatronConfig) -> float:
    """One layer's activations for one microbatch over tp: ``s·b·h·(18 + 4·ffn/h) / tp``."""
    return cfg.seq * cfg.micro_batch * cfg.hidden * (18 + 4 * cfg.ffn / cfg.hidden) / cfg.tp


def activation_bytes(cfg: MegatronConfig, microbatches: int | None = None) -> float:
    """The first pipeline rank's activations: every layer's worth (``pp`` microbatches of ``layers/pp``), the
    embedding's input and output for ``pp`` microbatches, the interleaving penalty, and at ``pp = 1`` the output
    layer's input and logits; over tp."""
    sbh = cfg.seq * cfg.micro_batch * cfg.hidden
    total = sbh * (18 + 4 * cfg.ffn / cfg.hidden) * cfg.layers
    total += 8 * cfg.seq * cfg.micro_batch * cfg.pp + sbh * cfg.pp
    if cfg.vp is not None:
        total *= 1 + (cfg.pp - 1) / (cfg.pp * cfg.vp)
    elif cfg.pp > 1 and microbatches is not None:
        total *= min(1, microbatches / cfg.pp)
    if cfg.pp == 1:
        total += sbh * 4 * (1 + cfg.padded_vocab / cfg.hidden)
    return total / cfg.tp


def theoretical_memory(cfg: MegatronConfig, microbatches: int | None = None) -> dict[str, float]:
    """Bytes on the most loaded rank: ``weights_and_optimizer``, ``activations``, ``total`` (and the inputs of
    each, for the comparison: ``parameters``, ``bytes_per_parameter``, ``layer_activations``)."""
    weights = weight_and_optimizer_bytes(cfg)
    activations = activation_bytes(cfg, microbatches)
    return {"weights_and_optimizer": weights, "activations": activations, "total": weights + activations,
            "parameters": most_loaded_parameters(cfg), "bytes_per_parameter": bytes_per_parameter(cfg),
            "layer_activations": layer_activation_bytes(cfg)}


def from_llama(config, layout, seq: int, micro_batch: int, swiglu: bool = True) -> MegatronConfig:
    """The formula's arguments for a transformers Llama config trained at fxshard ``layout`` (dp counts the ranks
    without cp, as Megatron's ``data_parallel_size``; ZeRO 1 is Megatron's distributed optimizer)."""
    return MegatronConfig(layers=config.num_hidden_layers, hidden=config.hidden_size, ffn=config.intermediate_size,
                          heads=config.num_attention_heads, groups=config.num_key_value_heads,
                          vocab=config.vocab_size, tp=layout.tp, pp=layout.pp,
                          vp=layout.stages_per_rank if layout.schedule == "interleaved-1f1b" else None,
                          dp=layout.dp, seq=seq, micro_batch=micro_batch, distributed_optimizer=layout.zero >= 1,
                          untie_embeddings=not config.tie_word_embeddings, swiglu=swiglu)
