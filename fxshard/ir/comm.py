"""The collectives a rank file can issue: one table entry per kind, the one home of what each kind means.

Every part of fxshard that needs to know what a collective does reads it here: the collectives pass (which
runtime function to insert), the static checks (the fake value of its output), code generation (the legend
of the rank-file header and the manifest's record), ``fxshard check`` (which backend operation each call
issues, forward and backward, and how to record it on meta tensors), the cost model (which buffer goes over
the wire) and the benchmarks.  Adding a kind (reduce-scatter for sequence parallelism, all-to-all for
experts) is one entry::

    >>> KINDS["copy_to"].backward, KINDS["all_reduce"].forward
    ('all_reduce', 'all_reduce')
    >>> [k.name for k in communicating("backward")][:6], KINDS["ring_attention_step"].forward
    (['copy_to', 'copy_to_linears', 'scatter', 'reduce_scatter', 'gather_to', 'linears_regathered'], 'send_recv')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxshard.runtime import collectives as rtc
from fxshard.runtime import context_parallel as rcp
from fxshard.runtime import experts as rte
from fxshard.runtime import fp8 as rfp8

# the bytes a rank sends, as a multiple of the collective's whole buffer, for ring algorithms over n ranks
WIRE: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,  # of the gathered buffer: (n - 1) parts of 1/n each
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # of the buffer: each rank keeps its own 1/n (balanced routing)
    "send_recv": lambda n: 2,  # a cp ring step: this rank's key block and its value block, sent once each
}


@dataclass(frozen=True)
class CollectiveKind:
    """One ``rt.<name>`` call of a rank file: ``function``, the runtime function itself (its name is the kind's).

    ``forward`` / ``backward``: the backend operation it issues when the forward runs / when autograd
    reaches it (``None``: nothing).  ``legend``: what it does, once in the rank-file header.  ``fake``:
    its local output from its local input (shapes only), given the group size.  The whole buffer that goes
    over the wire is the unsplit one: the input of a reduction, the output of a gather."""

    function: Callable
    forward: str | None
    backward: str | None
    legend: str
    fake: Callable[..., torch.Tensor]
    grouped: bool = True  # takes a process group (``shard`` does not: it keeps a part, no communication)
    outputs: tuple[str, ...] = ()  # a kind returning several values: their names in a rank file (``attn_out``, ...)
    # fp8 kinds: the directions in which the call all-reduces (MAX) the amaxes of its products, before its own
    # operation (``forward``/``backward``, if any); ``buffer``: (input elements, the local [out, in] shape of each
    # weight, keyword arguments, direction) -> the float32 elements of that all-reduce
    amaxes: tuple[str, ...] = ()
    buffer: Callable[..., object] | None = None

    @property
    def name(self) -> str:
        return self.function.__name__

    def ops(self, direction: str) -> tuple[tuple[str, bool], ...]:
        """``(backend operation, whether its buffer is the fp8 amaxes)`` of each operation a call issues in
        ``direction``, in the order it issues them::

            >>> KINDS["fp8_linears_regathered"].ops("backward")
            (('all_reduce', True), ('all_gather', False))
        """
        amax = (("all_reduce", True),) if direction in self.amaxes else ()
        op = getattr(self, direction)
        return amax + (((op, False),) if op else ())

    @property
    def communicates(self) -> bool:
        return bool(self.ops("forward") or self.ops("backward"))


def _gathered(x: torch.Tensor, size: int, dim: int, blocks: int = 1, sizes=(), replicas=()) -> torch.Tensor:
    if sizes or replicas:  # the whole size from the split's (a gradient path for fxshard check's meta run)
        whole = rtc._full_size(x.shape[dim], size, blocks, sizes, replicas)
        return torch.cat([x] * (whole // x.shape[dim]) + [x.narrow(dim, 0, whole % x.shape[dim])], dim=dim)
    return torch.cat([x] * size, dim=dim)  # the shape, and a gradient path for fxshard check's meta run


def _gathered_along(x: torch.Tensor, size: int, dim: int, balanced: bool = True) -> torch.Tensor:
    return torch.cat([x] * size, dim=dim)


def _part(x: torch.Tensor, size: int, dim: int, index: int, parts: int, blocks: int = 1, sizes=(),
          replicas=()) -> torch.Tensor:
    return rtc.shard(x, dim, index, parts, blocks, sizes, replicas)


def _part_zero(x: torch.Tensor, size: int, dim: int, blocks: int = 1, sizes=()) -> torch.Tensor:
    return rtc.shard(x, dim, 0, size, blocks, sizes)  # the shape of one rank's part


def _replicas(tensors: tuple, size: int, layouts=()) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)


def _own(x: torch.Tensor, size: int, dim: int, index: int, parts: int) -> torch.Tensor:
    return rtc.own_part(x, dim, index, parts)


def _same(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.clone()


def _reduced_part(x: torch.Tensor, size: int, dim: int, blocks: int = 1) -> torch.Tensor:
    return rtc.shard(x, dim, 0, size, blocks)  # the shape of one rank's part (a fresh buffer, as the reduce-scatter's)


def _linears(x: torch.Tensor, size: int, weights: tuple = (), biases: tuple = ()) -> tuple[torch.Tensor, ...]:
    return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def _regathered(x: torch.Tensor, size: int, shard=None, dim: int = 1, weights: tuple = (), biases: tuple = ()
                ) -> tuple[torch.Tensor, ...]:
    return _linears(x, size, weights, biases)  # the shapes, and the gradients' path for fxshard check


def _fp8_linear(x: torch.Tensor, size: int, weight=None, bias=None, **_) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)  # the shape, and the gradients' path for fxshard check


def _fp8_regathered(x: torch.Tensor, size: int, shard=None, dim: int = 1, weights: tuple = (), biases: tuple = (),
                    recipe: str = "tensorwise", amax_group=None) -> tuple[torch.Tensor, ...]:
    return _linears(x, size, weights, biases)  # the shapes, and the gradients' path for fxshard check


def op_group(args, kwargs: dict, amaxes: bool):
    """The process group one operation of a call goes over (a ``Group`` of the graph, a rank file's group, or its
    syntax): an fp8 call's amax all-reduce over ``amax_group=`` where the call has one (the fused fp8 linears under
    ``--cp``: amaxes over cp and tp, the gather over tp), every other operation over the call's group argument."""
    if amaxes and kwargs.get("amax_group") is not None:
        return kwargs["amax_group"]
    return args[1] if len(args) > 1 else kwargs.get("group")


def amax_weights(kwargs: dict) -> tuple:
    """The weights of an fp8 kind's call, from its keyword arguments (``weight=``, or a fused call's ``weights=``)."""
    return tuple(kwargs["weights"]) if "weights" in kwargs else (kwargs["weight"],)


def _amaxes(x_elements, weight_shapes, kwargs: dict, direction: str):
    recipe = kwargs.get("recipe", "tensorwise")
    rows = x_elements / weight_shapes[0][1]
    if "weights" in kwargs:  # fp8_linears_regathered
        return rfp8.fp8_amax_elements(recipe, rows, weight_shapes, direction)
    (out_features, in_features), = weight_shapes
    return rfp8.amax_elements(recipe, rows, in_features, out_features, direction, kwargs.get("split", "in"))


def _rows(x: torch.Tensor, size: int, **_) -> torch.Tensor:
    return x.clone()  # the rows an ep rank receives depend on the routing; balanced, as many as it sends


def _counts(offsets: torch.Tensor, size: int, **_) -> torch.Tensor:
    return offsets.new_empty((size, offsets.shape[0] // size), dtype=torch.int64)


def _batch_mean(x: torch.Tensor, size: int, rows=1, **_) -> torch.Tensor:
    return x / (rows * size) if not isinstance(rows, torch.Tensor) else x / rows


def _entered(x: torch.Tensor, size: int, dims: tuple = (), split: int | None = None, balanced: bool = True):
    return x.narrow(split, 0, x.shape[split] // size).clone() if split is not None else x.clone()


def _causal(q: torch.Tensor, size: int, keys: int, balanced: bool = True, block: int | None = None):
    rows = q.shape[-2]
    return torch.empty((rows, rows if block is not None else keys), dtype=torch.bool, device=q.device)


class _RankZero:
    """A cp group's stand-in for the cost model: rank 0 of ``size`` (every rank saves the same shapes)."""

    def __init__(self, size: int):
        self.rank, self.size = 0, size


def _causal_attention(q: torch.Tensor, size: int, key=None, value=None, scale: float = 1.0, balanced: bool = True):
    # the function itself, on the plan's fake tensors: what it saves for backward is what the plan counts
    return rcp.cp_causal_attention(q, _RankZero(size), key, value, scale, balanced)


def _ring(k: torch.Tensor, size: int, value=None, query=None, mask=None, **_):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]), dtype=torch.float32)
    return out, query.new_empty(query.shape[:-1], dtype=torch.float32), k.clone(), value.clone()


def _ring_last(k: torch.Tensor, size: int, **kwargs):
    return _ring(k, size, **kwargs)[:2]


def _moved(x: torch.Tensor, size: int, smaller: int, larger: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[smaller] //= size
    shape[larger] *= size
    return x.new_empty(shape)


def _to_heads(x, size, head_dim=1, seq_dim=2, balanced=True):
    return _moved(x, size, head_dim, seq_dim)


def _to_seq(x, size, head_dim=1, seq_dim=2, balanced=True):
    return _moved(x, size, seq_dim, head_dim)


# the fused ops whose outputs are column-parallel linears read by index (passes/overlap.py): their weights and biases
# in ``weights=`` and ``biases=``
FUSED_LINEARS = (rtc.copy_to_linears, rtc.linears_regathered, rfp8.fp8_linears_regathered)
FUSED_NAMES = tuple(f.__name__ for f in FUSED_LINEARS)
# those of them that keep the sp shard of their input for backward and gather it again there
REGATHERED = (rtc.linears_regathered, rfp8.fp8_linears_regathered)

KINDS: dict[str, CollectiveKind] = {k.name: k for k in (
    CollectiveKind(rtc.copy_to, None, "all_reduce",
                   "R: identity forward; all-reduce of the gradient backward (enters split compute)", _same),
    # passes/overlap.py: copy_to fused with the column-parallel linears reading it, for overlap in backward
    CollectiveKind(rtc.copy_to_linears, None, "all_reduce",
                   "R: copy_to and the column-parallel linears that read it, fused: backward starts the input "
                   "gradient's all-reduce, computes the weight gradients while it runs, then waits for it",
                   _linears),
    CollectiveKind(rtc.all_reduce, "all_reduce", None,
                   "P(sum) -> R: all-reduce forward; the gradient passes unchanged backward", _same),
    CollectiveKind(rtc.all_gather, "all_gather", None,
                   "S(d) -> R: all-gather along d forward; backward keeps this rank's part of the gradient",
                   _gathered),
    CollectiveKind(rtc.scatter, None, "all_gather",
                   "R -> S(d): keeps this rank's part forward; all-gather of the gradient backward", _part),
    # sequence parallelism (Megatron-LM's reduce-scatter <-> all-gather pair): the same bytes as an all-reduce
    CollectiveKind(rtc.reduce_scatter, "reduce_scatter", "all_gather",
                   "P(sum) -> S(d): reduce-scatter along d forward; all-gather of the gradient backward",
                   _reduced_part),
    CollectiveKind(rtc.gather_to, "all_gather", "reduce_scatter",
                   "S(d) -> R: all-gather along d forward; reduce-scatter of the gradient backward (enters split "
                   "compute)", _gathered),
    # passes/overlap.py under --sp: the column-parallel linears reading a gather_to's output save its shard and
    # gather it again in backward (Megatron-LM's way), 1/tp of the bytes kept
    CollectiveKind(rtc.linears_regathered, None, "all_gather",
                   "R: the column-parallel linears that read a gather_to's output, fused: they keep its sp shard for "
                   "backward (1/tp of the bytes) and all-gather it again there, while the input gradient computes",
                   _regathered),
    CollectiveKind(rtc.shard, None, None,
                   "R -> S(d): keeps this rank's part of a value without gradient (no communication)", _part,
                   grouped=False),
    # fp8 linears whose weight tp splits (passes/fp8.py): each scale the whole tensor's
    CollectiveKind(rfp8.fp8_linear_tp, None, None,
                   "fp8 linear (casts and scales, torchao's recipe) of a weight split over tp (or of tokens split over "
                   "cp): its amaxes all-reduced with MAX over its group, forward (input, weight) and backward "
                   "(gradient), a few float32 values each",
                   _fp8_linear, amaxes=("forward", "backward"), buffer=_amaxes),
    # passes/overlap.py under --sp and --fp8: rt.linears_regathered of column-parallel fp8 linears
    CollectiveKind(rfp8.fp8_linears_regathered, None, "all_gather",
                   "R: the column-parallel fp8 linears that read a gather_to's output, fused: their amaxes all-reduced "
                   "with MAX in one buffer each way (over amax_group where given: cp x tp); they keep its sp shard for backward (1/tp of the bytes) and "
                   "all-gather it again there, while the input gradient computes", _fp8_regathered,
                   amaxes=("forward", "backward"), buffer=_amaxes),
    # parts several tp ranks hold alike (key/value heads fewer than tp, a Mamba-2 mixer's B and C under fewer groups)
    CollectiveKind(rtc.sum_replicas, None, "all_reduce",
                   "S(d)/g weights (g parts over tp ranks): identity forward; backward sums the gradients of each part "
                   "over the ranks that hold it (one all-reduce of their slots per layer)", _replicas),
    CollectiveKind(rtc.own_part, None, None,
                   "S(d)/g -> S(d): this rank's share of a part tp/g ranks hold alike (no communication; "
                   "the gradient of the other shares is zero here)", _own, grouped=False),
    # a value an op mixing the batch's rows computed on the whole batch (passes/batch_rows.py), back to dp rows
    CollectiveKind(rtc.own_rows, None, None,
                   "whole batch -> S(d): this dp rank's rows of a value every rank computed alike (no communication; "
                   "the gradient of the other rows is zero here)", _part_zero),
    # a load-balancing loss's whole-batch means under a split batch (passes/router_loss.py), over dp
    CollectiveKind(rtc.batch_mean, "all_reduce", None,
                   "sums over this rank's rows -> the whole batch's mean: all-reduce over dp forward, / all rows; "
                   "backward x dp / all rows (DDP then averages over dp)", _batch_mean),
    # expert parallelism (passes/expert_parallel.py): a mixture-of-experts layer's token exchange over ep
    CollectiveKind(rte.exchange_counts, "all_to_all", None,
                   "rows per expert -> rows each ep rank sends to each of this rank's experts (all-to-all)",
                   _counts),
    CollectiveKind(rte.all_to_all_dispatch, "all_to_all", "all_to_all",
                   "rows sorted by expert -> the rows of this rank's experts (all-to-all, variable sizes); "
                   "backward sends their gradients back", _rows),
    CollectiveKind(rte.all_to_all_combine, "all_to_all", "all_to_all",
                   "expert outputs -> back to the ranks their rows came from, in their order (all-to-all); "
                   "backward dispatches the gradient", _rows),
    # context parallelism (passes/context_parallel.py, fxshard/runtime/context_parallel.py), over cp
    CollectiveKind(rcp.cp_enter, None, None,
                   "a value computed from the inputs on the whole sequence -> this cp rank's: each sequence dimension "
                   "in the cp ranks' (load-balanced) order, this rank's part kept (no communication)", _entered),
    CollectiveKind(rcp.cp_causal_mask, None, None,
                   "the causal mask of this cp rank's queries, from token positions in the cp order (no "
                   "communication)", _causal),
    CollectiveKind(rcp.cp_causal_attention, None, None,
                   "causal attention of this cp rank's queries over the gathered keys: each load-balanced chunk over "
                   "the chunks before it (unmasked) and itself (is_causal), merged by log-sum-exp; no S x S mask (no "
                   "communication)", _causal_attention),
    CollectiveKind(rcp.ring_attention_step, "send_recv", "send_recv",
                   "ring attention step: attend over the K/V block held now while it goes to the next cp rank and "
                   "the previous rank's arrives (send/recv); backward passes dK/dV back the same way", _ring,
                   outputs=("attn_out", "attn_lse", "next_key", "next_value")),
    CollectiveKind(rcp.ring_attention_last, None, None,
                   "the ring's last step: attend over the K/V block held now (no communication)", _ring_last,
                   outputs=("attn_out", "attn_lse")),
    CollectiveKind(rcp.seq_to_heads, "all_to_all", "all_to_all",
                   "S(seq) -> S(heads): all-to-all over cp, the whole sequence and 1/cp of the heads (Ulysses); "
                   "backward the inverse", _to_heads),
    CollectiveKind(rcp.heads_to_seq, "all_to_all", "all_to_all",
                   "S(heads) -> S(seq): all-to-all over cp back to this rank's tokens; backward the inverse", _to_seq),
    CollectiveKind(rcp.cp_leave, "all_gather", None,
                   "S(seq) -> R: all-gather over cp and back to the natural order (a returned value); backward keeps "
                   "this rank's part", _gathered_along),
)}
BY_FUNCTION = {k.function: k for k in KINDS.values()}

# the collectives the runtime issues on its own behalf, which fxshard check records too
SUM_TIED_GRADS = "sum_tied_grads"  # all-reduce of a tied weight's gradient between pipeline stages


def kind_of(target) -> CollectiveKind | None:
    """The kind of a graph node's target (a runtime collective), or None for anything else."""
    return BY_FUNCTION.get(target)


def communicating(direction: str) -> list[CollectiveKind]:
    """The kinds that issue a backend operation in ``direction`` (``forward`` or ``backward``)."""
    return [k for k in KINDS.values() if k.ops(direction)]


def buffer_is_input(kind: CollectiveKind, direction: str) -> bool:
    """Whether the whole buffer of ``kind``'s operation in ``direction`` has the shape of the call's input
    (a reduction, or a scatter whose gradient is gathered back to the input's shape) rather than its output
    (a gather forward; a gather's gradient reduce-scattered backward, which has the output's shape)."""
    op = getattr(kind, direction)
    return op is not None and (op, direction) not in (("all_gather", "forward"), ("reduce_scatter", "backward"))
