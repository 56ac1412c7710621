"""One Llama layer's activations for one microbatch, term by term: what fxshard's program saves beside what
Megatron-LM's theoretical formula charges (:mod:`benchmarks.megatron_memory`), to explain their ratio.

fxshard's side restates what :mod:`fxshard.cost.saved` traces in transformers' ``LlamaDecoderLayer`` compiled
with ``--sp`` (``tests/benchmarks/test_layer_terms.py`` checks the restatement against the trace): per token,

- **norms**: each RMSNorm keeps its fp32 input (``pow`` and ``mul`` save it: 4h bytes), its bf16 normalized output
  (the weight's ``mul`` saves it: 2h) and its fp32 ``rsqrt`` (4), over tp under sp;
- **column-parallel inputs**: q/k/v's and gate/up's input, all-gathered over tp and kept whole by ``linear``
  (2h each); Megatron keeps the local shard and gathers it again in backward;
- **attention**: SDPA keeps q, k and v, its output (o_proj's input, the same storage) and the logsumexp (4 bytes a
  head); the captured graph repeats k and v to the query heads (transformers' ``repeat_kv``: exported models call
  SDPA without ``enable_gqa``), so they are 2h each, not ``2h·kv/heads``;
- **MLP**: gate, silu(gate), up and their product (``silu``, ``mul`` and ``down_proj`` each save theirs): 8·ffn;
- **RoPE**: the cos and sin tables (2·head_dim bytes each a position, one copy for the microbatch's rows).

Megatron's side is Korthikanti et al. 2022's layer (sequence parallelism, attention's ``s²`` terms gone):
``2h`` per norm input, ``2h`` per column-parallel input, ``4h`` for Q and K and ``2h`` for V (at the query
heads), ``2h`` for the output projection's input, ``4·ffn`` for the MLP, and a 1-byte dropout mask of h after
attention and after the MLP: ``18h + 4·ffn`` over tp.  Llama recipes train without dropout::

    ours = fxshard_layer(hidden=8192, ffn=28672, heads=64, kv_heads=8, seq=8192, tp=4)
    sum(ours.values()) / 2**20      # 1028.5 MiB
"""

from __future__ import annotations

TERMS = ("norms", "column-parallel inputs", "attention", "MLP", "dropout masks", "RoPE")


def fxshard_layer(hidden: int, ffn: int, heads: int, kv_heads: int, seq: int, tp: int, rows: int = 1,
                  sp: bool = True) -> dict[str, float]:
    """Bytes fxshard's bf16 program keeps of one layer for one microbatch of ``rows`` x ``seq`` tokens, per
    :data:`TERMS` (``seq``: the tokens one cp rank holds; ``kv_heads`` is not read: k and v are repeated)."""
    tokens, d = rows * seq, hidden // heads
    shard = tp if sp else 1
    return {"norms": 2 * (4 * hidden + 2 * hidden + 4) * tokens / shard,
            "column-parallel inputs": 2 * 2 * hidden * tokens,
            "attention": (4 * 2 * hidden + 4 * heads) * tokens / tp,
            "MLP": 4 * 2 * ffn * tokens / tp,
            "dropout masks": 0.0,
            "RoPE": 2 * 2 * d * seq}


def formula_layer(hidden: int, ffn: int, seq: int, tp: int, rows: int = 1) -> dict[str, float]:
    """Megatron's formula for the same layer, per :data:`TERMS` (its sum is
    :func:`benchmarks.megatron_memory.layer_activation_bytes`)."""
    tokens = rows * seq
    return {"norms": 2 * 2 * hidden * tokens / tp,
            "column-parallel inputs": 2 * 2 * hidden * tokens / tp,
            "attention": (4 + 2 + 2) * hidden * tokens / tp,
            "MLP": 4 * ffn * tokens / tp,
            "dropout masks": 2 * hidden * tokens / tp,
            "RoPE": 0.0}


def exact_savings(hidden: int, ffn: int, heads: int, kv_heads: int, seq: int, tp: int,
                  rows: int = 1) -> dict[str, float]:
    """Bytes a layer a microbatch that fxshard's program (with ``--sp``) would keep less by four exact changes,
    none made yet: each keeps the same values or computes them again from what it keeps.

    - keep the sp shard of q/k/v's and gate/up's input and all-gather it again in backward (Megatron's way);
    - compute silu(gate) again in backward from the gate it keeps (Transformer Engine's SwiGLU keeps 6·ffn);
    - keep each norm's bf16 input, cast to fp32 again in backward (the cast is exact), not its fp32 copy;
    - call SDPA with ``enable_gqa`` on the kv heads rather than on k and v repeated to the query heads."""
    tokens = rows * seq
    return {"sp shard kept": 2 * 2 * hidden * tokens * (1 - 1 / tp),
            "silu(gate) recomputed": 2 * ffn * tokens / tp,
            "norm input kept in bf16": 2 * 2 * hidden * tokens / tp,
            "SDPA with enable_gqa": 2 * 2 * hidden * (1 - kv_heads / heads) * tokens / tp}
