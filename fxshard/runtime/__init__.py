"""What generated rank files import, and nothing else: collectives, local TP pieces, loading."""

from fxshard.runtime import ctc  # noqa: F401  registers torch.ops.fxshard.ctc_loss, which rank files may call
from fxshard.runtime.activations import rms_normalize, silu_mul
from fxshard.runtime.batch_norm import batch_norm_from_stats, batch_stats
from fxshard.runtime.collectives import (
    all_gather,
    all_reduce,
    batch_mean,
    copy_to,
    copy_to_linears,
    gather_to,
    linears_regathered,
    own_part,
    own_rows,
    reduce_scatter,
    scatter,
    shard,
    sum_replicas,
)
from fxshard.runtime.context_parallel import (
    cp_causal_attention,
    cp_causal_mask,
    cp_enter,
    cp_leave,
    heads_to_seq,
    merge_attention,
    ring_attention_last,
    ring_attention_step,
    seq_to_heads,
)
from fxshard.runtime.data_parallel import ddp, fully_shard
from fxshard.runtime.draws import draw
from fxshard.runtime.experts import all_to_all_combine, all_to_all_dispatch, exchange_counts, expert_offsets
from fxshard.runtime.fp8 import fp8_linear, fp8_linear_tp, fp8_linears_regathered
from fxshard.runtime.functions import TENSOR, autograd_function
from fxshard.runtime.loss import token_mean
from fxshard.runtime.pipeline import sum_tied_grads
from fxshard.runtime.random import dropout
from fxshard.runtime.recompute import recompute
from fxshard.runtime.state import load_state
from fxshard.runtime.tensor_parallel import vocab_cross_entropy, vocab_cross_entropy_parts, vocab_embedding

__all__ = ["all_gather", "all_reduce", "batch_mean", "copy_to", "copy_to_linears", "gather_to", "linears_regathered",
           "reduce_scatter",
           "scatter", "shard", "own_part", "own_rows", "sum_replicas", "silu_mul", "rms_normalize",
           "vocab_embedding",
           "vocab_cross_entropy",
           "vocab_cross_entropy_parts", "load_state",
           "sum_tied_grads", "ddp", "fully_shard", "dropout", "draw", "recompute", "token_mean", "autograd_function",
           "TENSOR", "exchange_counts", "all_to_all_dispatch", "all_to_all_combine", "expert_offsets", "cp_enter",
           "cp_causal_attention", "cp_causal_mask", "cp_leave", "ring_attention_step", "ring_attention_last",
           "merge_attention",
           "seq_to_heads", "heads_to_seq", "batch_stats",
           "batch_norm_from_stats", "fp8_linear", "fp8_linear_tp", "fp8_linears_regathered"]
