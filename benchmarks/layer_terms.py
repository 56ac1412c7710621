"""One Llama layer's activations for one microbatch, term by term: what fxshard's program saves beside what
Megatron-LM's theoretical formula charges (:mod:`benchmarks.megatron_memory`), to explain their ratio.

fxshard's side restates what :mod:`fxshard.cost.saved` traces in transformers' ``LlamaDecoderLayer`` compiled
with ``--sp`` and ``--dtype bf16`` (``tests/benchmarks/test_layer_terms.py`` checks the restatement against the
trace): per token,

- **norms**: each RMSNorm keeps its bf16 input (``rt.rms_normalize`` runs its fp32 ops again in backward: 2h) and
  its bf16 normalized output (the weight's ``mul`` saves it: 2h), over tp under sp;
- **column-parallel inputs**: q/k/v's and gate/up's input (2h each), its sp shard kept (over tp), gathered again
  in backward (``rt.linears_regathered``), as Megatron does;
- **attention**: SDPA keeps q, k and v, its output (o_proj's input, the same storage) and the logsumexp (4 bytes a
  head); k and v at the kv heads (``enable_gqa``: ``2h·kv/heads`` each);
- **MLP**: gate, up and their product (``rt.silu_mul`` keeps gate and up, ``down_proj`` its input): 6·ffn;
- **RoPE**: the cos and sin tables (2·head_dim bytes each a position, one copy for the microbatch's rows).

Megatron's side is Korthikanti et al. 2022's layer (sequence parallelism, attention's ``s²`` terms gone):
``2h`` per norm input, ``2h`` per column-parallel input, ``4h`` for Q and K and ``2h`` for V (at the query
heads), ``2h`` for the output projection's input, ``4·ffn`` for the MLP, and a 1-byte dropout mask of h after
attention and after the MLP: ``18h + 4·ffn`` over tp.  Llama recipes train without dropout::

    ours = fxshard_layer(hidden=8192, ffn=28672, heads=64, kv_heads=8, seq=8192, tp=4)
    sum(ours.values()) / 2**20      # 604.5 MiB
"""

from __future__ import annotations

TERMS = ("norms", "column-parallel inputs", "attention", "MLP", "dropout masks", "RoPE")


def fxshard_layer(hidden: int, ffn: int, heads: int, kv_heads: int, seq: int, tp: int, rows: int = 1,
                  sp: bool = True) -> dict[str, float]:
    """Bytes fxshard's bf16 program keeps of one layer for one microbatch of ``rows`` x ``seq`` tokens, per
    :data:`TERMS` (``seq``: the tokens one cp rank holds)."""
    tokens, d = rows * seq, hidden // heads
    shard = tp if sp else 1
    return {"norms": 2 * (2 * hidden + 2 * hidden) * tokens / shard,
            "column-parallel inputs": 2 * 2 * hidden * tokens / shard,
            "attention": (2 * 2 * hidden + 2 * 2 * hidden * kv_heads / heads + 4 * heads) * tokens / tp,
            "MLP": 3 * 2 * ffn * tokens / tp,
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


def savings_made(hidden: int, ffn: int, heads: int, kv_heads: int, seq: int, tp: int,
                 rows: int = 1) -> dict[str, float]:
    """Bytes a layer a microbatch that fxshard's program (with ``--sp``) keeps less than it did before four exact
    changes (each keeps the same values or computes them again from what it keeps; ``tests/test_saved_activations.py``
    measures each):

    - the sp shard of q/k/v's and gate/up's input kept, all-gathered again in backward (``rt.linears_regathered``);
    - silu(gate) computed again in backward from the gate kept (``rt.silu_mul``);
    - each norm's bf16 input kept, its fp32 ops run again in backward (``rt.rms_normalize``: the fp32 copy and rsqrt);
    - SDPA with ``enable_gqa`` on the kv heads, not on k and v repeated to the query heads."""
    tokens = rows * seq
    return {"sp shard kept": 2 * 2 * hidden * tokens * (1 - 1 / tp),
            "silu(gate) recomputed": 2 * ffn * tokens / tp,
            "norm input kept in bf16": 2 * (2 * hidden + 4) * tokens / tp,
            "SDPA with enable_gqa": 2 * 2 * hidden * (1 - kv_heads / heads) * tokens / tp}
