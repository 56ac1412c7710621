"""Collectives the generated code calls, each correct under autograd (Megatron semantics).

=============  =======================  ==========================
function       forward                  backward
=============  =======================  ==========================
copy_to        identity                 all-reduce (sum)
all_reduce     all-reduce (sum)         identity
all_gather     all-gather along dim     keep this rank's part
scatter        keep this rank's part    all-gather along dim
reduce_scatter reduce-scatter along dim all-gather along dim
gather_to      all-gather along dim     reduce-scatter along dim
copy_to_linears copy_to + its column-   all-reduce of the input gradient, started before the weight
               parallel linears         gradients are computed and waited for after them (overlap)
linears_regathered the column-parallel  all-gather of the sp shard they saved (their input again), overlapped
               linears reading a        with the input gradient; the weight gradients from it
               gather_to's output
batch_mean     all-reduce, / all rows   x n / all rows (DDP averages)
sum_replicas   identity                 all-reduce of the parts several ranks hold alike (their gradients
                                        summed over those ranks), one call for a layer's weights
own_part       this rank's share of a   the gradient in that share, zeros elsewhere (no communication)
               part its replicas hold
own_rows       this dp rank's rows of a the gradient in those rows, zeros elsewhere (no communication)
               value computed whole
=============  =======================  ==========================

Splits of unequal packed blocks, or of parts several ranks hold alike (``sizes``, ``replicas``: see
:class:`fxshard.runtime.slices.SliceSpec`), are gathered and scattered by their slices: a replicated part's gradient
is partial on each of its ranks (each computed what it read), so the gather's backward keeps it on the first of
them only and the scatter's backward sums it.

``reduce_scatter`` and ``gather_to`` are sequence parallelism's pair (Megatron-LM's
``reduce_scatter_to_sequence_parallel_region`` / ``gather_from_sequence_parallel_region``): the first
replaces the all-reduce after a row-parallel layer, the second the identity before a column-parallel one;
together they move the bytes of the all-reduce they replace.

``copy_to_linears`` is ``copy_to`` fused with the column-parallel linears that read its output
(``passes/overlap.py``), Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``: in backward it
computes the input gradient first, starts its all-reduce asynchronously, computes the weight and bias
gradients while the all-reduce runs, and waits for it last.  Same bytes, same values (the gradients are the
ones autograd's linear backward computes, summed in the order autograd would sum them).

``linears_regathered`` (``passes/overlap.py``, under ``--sp``) is the column-parallel linears that read a
``gather_to``'s output, saving the sp shard the gather read instead of its output, as Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication`` does under sequence parallelism: 1/tp of the bytes kept for
backward, one more all-gather in backward (started before the input gradient is computed, waited for before the
weight gradients need it).  Same values: the gathered input is the same tensor again.

``shard`` keeps this rank's part of a tensor that needs no gradient (no communication).
A collective that does not complete within the process group's timeout raises an error naming the
rank, the group, the collective and the line of the generated file that issued it (see
``fxshard.runtime.guard``); the backward of ``copy_to`` and ``scatter`` names the forward's line.

Under ``torch.compile`` (``fxshard run --compile``) the same functions trace as functional collectives
(``torch.distributed._functional_collectives``: one graph node each, an op and its ``wait_tensor``), inside
the same autograd Functions, so a rank's forward and backward each compile to one graph and the Megatron
semantics above are kept (the expert exchanges of ``--ep``, whose sizes are the routing's, are the exception:
graph breaks, see :mod:`fxshard.runtime.experts`).  The ``guarded`` wrapper (Python around each call) cannot live in a
graph: a collective that fails there raises torch's own error after the process group's timeout, which the training
step turns into one naming the rank, the step and the group (``guard.named_phase``), without the line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from fxshard.runtime.guard import call_site as _site
from fxshard.runtime.guard import guarded
from fxshard.runtime.slices import SliceSpec, part_ranges, place, take


def _dense(x: torch.Tensor) -> torch.Tensor:
    """A gradient as a strided tensor: ``Embedding(sparse=True)``, looked up whole (its rule declines the
    split), gives its weight a sparse one, which the collectives' backwards slice and sum."""
    return x.to_dense() if x.is_sparse else x


def _compiling() -> bool:
    """Whether dynamo is tracing this call (``fxshard run --compile``): use functional collectives."""
    return torch.compiler.is_compiling()


def _all_reduce(x: torch.Tensor, group, what: str, site=None) -> torch.Tensor:
    if _compiling():
        return funcol.all_reduce(_dense(x).contiguous(), "sum", group)
    x = _dense(x).contiguous().clone()
    with guarded(what, group, x, site):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int, blocks: int, what: str, site=None, sizes=(),
                replicas=()) -> torch.Tensor:
    world = dist.get_world_size(group)
    if sizes or replicas:
        return _gather_slices(x, group, dim, blocks, sizes, replicas, what, site)
    if _compiling():
        return _functional_all_gather(x, group, dim % x.dim(), blocks, world)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    with guarded(what, group, x, site):
        dist.all_gather(parts, x.contiguous(), group=group)
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    # each rank holds [b0_r, b1_r, ...]: put its blocks back where they sit in [b0_0, b0_1, ..., b1_0, ...]
    full = x.new_empty([s * world if d == dim else s for d, s in enumerate(x.shape)])
    for r, p in enumerate(parts):
        place(full, p, SliceSpec(dim, r, world, blocks))
    return full


def _gather_slices(x: torch.Tensor, group, dim: int, blocks: int, sizes, replicas, what: str, site) -> torch.Tensor:
    """Every rank's part of a split of unequal or replicated blocks, put where its slice says (replicas overwrite
    each other with the same values)."""
    world = dist.get_world_size(group)
    dim %= x.dim()
    if _compiling():
        parts = funcol.all_gather_tensor(x.contiguous(), 0, group).chunk(world, 0)
    else:
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
        with guarded(what, group, x, site):
            dist.all_gather(parts, x.contiguous(), group=group)
    full = x.new_empty([_full_size(x.shape[dim], world, blocks, sizes, replicas) if d == dim else s
                        for d, s in enumerate(x.shape)])
    for r, p in enumerate(parts):
        place(full, p, SliceSpec(dim, r, world, blocks, tuple(sizes), tuple(replicas)))
    return full


def _full_size(local: int, parts: int, blocks: int, sizes, replicas) -> int:
    """The whole size of a dimension whose split has ``local`` elements on each of ``parts`` ranks."""
    if sizes:
        return sum(sizes)
    per_block = [parts // (replicas[b] if replicas else 1) for b in range(blocks)]  # parts per block
    # local = sum(block / per_block[b]) with equal blocks: block = local / sum(1 / per_block)
    block = round(local / sum(1 / n for n in per_block))
    return block * blocks


def _own_slice(grad: torch.Tensor, dim: int, index: int, parts: int, blocks: int, sizes, replicas) -> torch.Tensor:
    """This rank's part of a whole gradient; a part it holds with other ranks is kept by the first of them only,
    zero on the others (replicas' gradients are partial: their sum is the part's gradient)."""
    sl = SliceSpec(dim % grad.dim(), index, parts, blocks, tuple(sizes), tuple(replicas))
    pieces = []
    for b, (a, e) in enumerate(sl.ranges(grad.shape[sl.dim])):
        piece = grad.narrow(sl.dim, a, e - a)
        k = replicas[b] if replicas else 1
        pieces.append(piece if index % k == 0 else torch.zeros_like(piece))
    return torch.cat(pieces, dim=sl.dim) if len(pieces) > 1 else pieces[0].contiguous()


def _sum_into_slices(grad: torch.Tensor, group, dim: int, full: int, blocks: int, sizes, replicas, what: str,
                     site) -> torch.Tensor:
    """The whole gradient of a value scattered into unequal or replicated blocks: each rank's part placed in a zero
    tensor of the whole size and summed over the group (a replicated part's gradients add up)."""
    index = dist.get_rank(group)
    sl = SliceSpec(dim % grad.dim(), index, dist.get_world_size(group), blocks, tuple(sizes), tuple(replicas))
    whole = grad.new_zeros([full if d == sl.dim else s for d, s in enumerate(grad.shape)])
    place(whole, grad, sl)
    return _all_reduce(whole, group, what, site)


def _functional_all_gather(x: torch.Tensor, group, dim: int, blocks: int, world: int) -> torch.Tensor:
    """:func:`_all_gather` as one functional all-gather (along dim 0) and copies, which dynamo traces."""
    parts = funcol.all_gather_tensor(x.contiguous(), 0, group).chunk(world, 0)
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    # [..., blocks, world, part, ...]: block b of every rank in rank order, then the next block
    return torch.stack([p.unflatten(dim, (blocks, -1)) for p in parts], dim=dim + 1).flatten(dim, dim + 2)


def _reduce_scatter(x: torch.Tensor, group, dim: int, blocks: int, what: str, site=None) -> torch.Tensor:
    x = _dense(x)
    dim %= x.dim()
    if blocks > 1:  # rank r keeps part r of each block: [b0_r, b1_r, ...], as SliceSpec's blocks
        x = x.unflatten(dim, (blocks, -1))
    if _compiling():
        out = funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim + (blocks > 1), group)
        return out.flatten(dim, dim + 1) if blocks > 1 else out
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=dim + (blocks > 1))]
    out = torch.empty_like(parts[0])
    with guarded(what, group, x, site):
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out.flatten(dim, dim + 1) if blocks > 1 else out


def _take(x: torch.Tensor, dim: int, index: int, parts: int, blocks: int, sizes=(), replicas=()) -> torch.Tensor:
    return take(x, SliceSpec(dim % x.dim(), index, parts, blocks, tuple(sizes), tuple(replicas))).contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "all_reduce (backward of copy_to)", ctx.site), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        return _all_reduce(x, group, "all_reduce", site)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _BatchMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rows, site):
        n = dist.get_world_size(group)
        if isinstance(rows, torch.Tensor):  # a counted number of rows (a mask's sum): summed with the sums, one call
            both = _all_reduce(torch.cat([x.reshape(-1), rows.reshape(1).to(x.dtype)]), group,
                               "all_reduce (whole-batch mean)", site)
            x_sum, total = both[:-1].view_as(x), both[-1]
        else:  # the same number of rows on every rank (the batch splits evenly over dp)
            x_sum, total = _all_reduce(x, group, "all_reduce (whole-batch mean)", site), rows * n
        ctx.scale = n / total
        return x_sum / total

    @staticmethod
    def backward(ctx, grad):
        # d mean / d x is 1/total on one device; DDP then averages the ranks' gradients (divides by n)
        return grad * ctx.scale, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, blocks, site, sizes=(), replicas=()):
        ctx.group, ctx.dim, ctx.blocks, ctx.sizes, ctx.replicas = group, dim, blocks, sizes, replicas
        return _all_gather(x, group, dim, blocks, "all_gather", site, sizes, replicas)

    @staticmethod
    def backward(ctx, grad):
        index, parts = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        if ctx.sizes or ctx.replicas:
            local = _own_slice(_dense(grad), ctx.dim, index, parts, ctx.blocks, ctx.sizes, ctx.replicas)
        else:
            local = _take(_dense(grad), ctx.dim, index, parts, ctx.blocks)
        return local, *([None] * 6)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, index, parts, blocks, site, sizes=(), replicas=()):
        ctx.group, ctx.dim, ctx.blocks, ctx.site, ctx.sizes, ctx.replicas = group, dim, blocks, site, sizes, replicas
        ctx.full = x.shape[dim]
        return _take(x, dim, index, parts, blocks, sizes, replicas)

    @staticmethod
    def backward(ctx, grad):
        what = "all_gather (backward of scatter)"
        if ctx.sizes or ctx.replicas:
            whole = _sum_into_slices(_dense(grad), ctx.group, ctx.dim, ctx.full, ctx.blocks, ctx.sizes, ctx.replicas,
                                     "all_reduce (backward of scatter)", ctx.site)
            return whole, *([None] * 8)
        gathered = _all_gather(grad, ctx.group, ctx.dim, ctx.blocks, what, ctx.site)
        return gathered, *([None] * 8)


class _SumReplicas(torch.autograd.Function):
    """Identity on a layer's weights whose parts several ranks hold alike; backward sums, over the group, the
    gradients of those parts (each rank's is partial), in one all-reduce of their slots."""

    @staticmethod
    def forward(ctx, group, site, layouts, *tensors):
        ctx.group, ctx.site, ctx.layouts = group, site, layouts
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        buffers, spans = [], []
        for g, layout in zip(grads, ctx.layouts, strict=True):
            g = torch.zeros(()) if g is None else _dense(g)
            dim, pieces = layout
            for start, length, slot, slots in pieces:  # a replicated part: its slot among the parts of its block
                buf = g.new_zeros([length * slots if d == dim % g.dim() else s for d, s in enumerate(g.shape)])
                buf.narrow(dim % g.dim(), slot * length, length).copy_(g.narrow(dim % g.dim(), start, length))
                buffers.append(buf.reshape(-1))
                spans.append(buf.shape)
        summed = _all_reduce(torch.cat(buffers), ctx.group, "all_reduce (backward of sum_replicas)", ctx.site)
        out, at, k = [], 0, 0
        for g, layout in zip(grads, ctx.layouts, strict=True):
            if g is None:
                out.append(None)
                k += len(layout[1])
                continue
            g = _dense(g).clone()
            dim, pieces = layout
            for start, length, slot, _slots in pieces:
                n = spans[k].numel()
                buf = summed[at:at + n].view(spans[k])
                g.narrow(dim % g.dim(), start, length).copy_(buf.narrow(dim % g.dim(), slot * length, length))
                at, k = at + n, k + 1
            out.append(g)
        return None, None, None, *out


def sum_replicas(tensors: tuple, group, layouts: tuple) -> tuple[torch.Tensor, ...]:
    """``tensors`` as they are; backward, the gradients of their replicated parts summed over ``group``.

    ``layouts[i] = (dim, ((start, length, slot, slots), ...))``: along ``dim`` of tensor i, each part this rank
    holds with other ranks: where it sits locally, and its slot among the ``slots`` parts of its block (the ranks
    sharing it have the same slot).  One all-reduce of every part in its slot of a zero buffer sums each part
    over exactly the ranks that hold it (the key/value projections of a layer whose heads are fewer than tp)."""
    return _SumReplicas.apply(group, None if _compiling() else _site(), layouts, *tensors)


def own_rows(x: torch.Tensor, group, dim: int, blocks: int = 1, sizes: tuple = ()) -> torch.Tensor:
    """This rank's part along ``dim`` (inside each of ``blocks`` blocks, of ``sizes`` if unequal) of a value every
    rank of ``group`` computed alike on the whole batch (an op that mixes the batch's rows, ``passes/batch_rows.py``).
    Backward puts the gradient in that part, zeros elsewhere: the whole computation's ``gather_to`` sums the ranks'
    gradients."""
    spans = part_ranges(x.shape[dim], dist.get_rank(group), dist.get_world_size(group), blocks, tuple(sizes))
    pieces = [x.narrow(dim, a, b - a) for a, b in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def own_part(x: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` of a local value that ``parts`` ranks hold alike: this rank's share (a key/value
    head's copy on each of its ranks, cut to the heads its queries read).  Backward puts the gradient in that share,
    zeros elsewhere: the replicas' gradients are partial, summed where the value was made."""
    return x.narrow(dim, x.shape[dim] // parts * index, x.shape[dim] // parts)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, blocks, site):
        ctx.group, ctx.dim, ctx.blocks, ctx.site = group, dim, blocks, site
        return _reduce_scatter(x, group, dim, blocks, "reduce_scatter", site)

    @staticmethod
    def backward(ctx, grad):
        gathered = _all_gather(grad, ctx.group, ctx.dim, ctx.blocks, "all_gather (backward of reduce_scatter)",
                               ctx.site)
        return gathered, None, None, None, None


class _GatherTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, blocks, site):
        ctx.group, ctx.dim, ctx.blocks, ctx.site = group, dim, blocks, site
        return _all_gather(x, group, dim, blocks, "all_gather", site)

    @staticmethod
    def backward(ctx, grad):
        what = "reduce_scatter (backward of gather_to)"
        return _reduce_scatter(grad, ctx.group, ctx.dim, ctx.blocks, what, ctx.site), None, None, None, None


class _CopyToLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site, n, *weights_and_biases):
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.group, ctx.site, ctx.biases = group, site, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        flat = [g.reshape(-1, g.shape[-1]) for g in grads]
        # the input gradient first, summed as autograd sums what the linears send it: the last linear's first
        dx = None
        for g, w in reversed(list(zip(flat, weights, strict=True))):
            part = g.mm(w)
            dx = part if dx is None else dx + part
        dx = dx.reshape(x.shape)
        x2 = x.reshape(-1, x.shape[-1])
        with guarded("all_reduce (backward of copy_to_linears, overlapped with the weight gradients)", ctx.group,
                     dx, ctx.site):
            work = dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)  # start
            dw = [x2.t().mm(g).t() for g in flat]  # what autograd's addmm backward computes, while it runs
            db = [g.sum(0) if has else None for g, has in zip(flat, ctx.biases, strict=True)]
            work.wait()
        return dx, None, None, None, *dw, *db


class _LinearsRegathered(torch.autograd.Function):
    """The column-parallel linears reading ``gathered``, the all-gather of ``shard`` over the group along ``dim``:
    forward they read ``gathered``; they save ``shard`` (1/tp of it), and backward gathers it again for the weight
    gradients (started first, waited for after the input gradient is computed).  ``group`` None: forward only
    (the cost model's trace of what it saves)."""

    @staticmethod
    def forward(ctx, gathered, shard, group, dim, site, n, *weights_and_biases):
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.group, ctx.dim, ctx.site, ctx.biases = group, dim, site, [b is not None for b in biases]
        ctx.save_for_backward(shard, *weights)
        return tuple(torch.nn.functional.linear(gathered, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        shard, *weights = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        parts = [torch.empty_like(shard, memory_format=torch.contiguous_format) for _ in range(world)]
        with guarded("all_gather (backward of linears_regathered: their input again, overlapped with the input "
                     "gradient)", ctx.group, shard, ctx.site):
            work = dist.all_gather(parts, shard.contiguous(), group=ctx.group, async_op=True)  # start
            flat = [g.reshape(-1, g.shape[-1]) for g in grads]
            # the input gradient, summed as autograd sums what the linears send it: the last linear's first
            dx = None
            for g, w in reversed(list(zip(flat, weights, strict=True))):
                part = g.mm(w)
                dx = part if dx is None else dx + part
            work.wait()
        x = torch.cat(parts, dim=ctx.dim)
        dx = dx.reshape(x.shape)
        x2 = x.reshape(-1, x.shape[-1])
        dw = [x2.t().mm(g).t() for g in flat]  # what autograd's addmm backward computes
        db = [g.sum(0) if has else None for g, has in zip(flat, ctx.biases, strict=True)]
        return dx, None, None, None, None, None, *dw, *db


def linears_regathered(x: torch.Tensor, group, shard: torch.Tensor, dim: int, weights: tuple, biases: tuple
                       ) -> tuple[torch.Tensor, ...]:
    """``linear(x, weights[i], biases[i])`` for each i, where ``x`` is ``gather_to(shard, group, dim)``: saving
    ``shard`` for backward rather than ``x`` and all-gathering it again there (sequence parallelism's column-parallel
    input as Megatron-LM keeps it: 1/tp of the bytes).  Under torch.compile, the linears, for the compiler to
    choose what it saves."""
    if _compiling():
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    return _LinearsRegathered.apply(x, shard, group, dim, _site(), len(weights), *weights, *biases)


def copy_to_linears(x: torch.Tensor, group, weights: tuple, biases: tuple) -> tuple[torch.Tensor, ...]:
    """``copy_to(x)`` and ``linear(·, weights[i], biases[i])`` for each i, fused so that backward overlaps the
    input gradient's all-reduce with the weight gradients (see the module docstring).  Under torch.compile,
    ``copy_to`` and the linears, for the compiler to schedule."""
    if _compiling():
        x = copy_to(x, group)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    return _CopyToLinears.apply(x, group, _site(), len(weights), *weights, *biases)


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyTo.apply(x, group, None if _compiling() else _site())


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results over ``group``; the gradient passes through unchanged."""
    return _AllReduce.apply(x, group, None if _compiling() else _site())


def batch_mean(x: torch.Tensor, group, rows) -> torch.Tensor:
    """The mean over the whole batch of per-row values whose sum over this rank's ``rows`` rows is ``x``: the sums
    (and a counted ``rows`` tensor) all-reduced over ``group`` (dp), divided by the rows of all ranks.  Backward:
    n / (all rows) times the gradient, which DDP's average over the n ranks makes the single-device 1 / (all rows).
    Mixture-of-experts load-balancing losses use it for their whole-batch means (passes/router_loss.py)."""
    return _BatchMean.apply(x, group, rows, _site())


def all_gather(x: torch.Tensor, group, dim: int, blocks: int = 1, sizes: tuple = (), replicas: tuple = ()
               ) -> torch.Tensor:
    """Concatenate every rank's part along ``dim``; backward keeps this rank's part of the gradient.  ``sizes``,
    ``replicas``: unequal or replicated blocks (module docstring)."""
    return _AllGather.apply(x, group, dim, blocks, None if _compiling() else _site(), tuple(sizes), tuple(replicas))


def scatter(x: torch.Tensor, group, dim: int, index: int, parts: int, blocks: int = 1, sizes: tuple = (),
            replicas: tuple = ()) -> torch.Tensor:
    """Keep part ``index`` of ``parts`` along ``dim``; backward all-gathers the gradient (sums it into place, for
    unequal or replicated blocks)."""
    return _Scatter.apply(x, group, dim, index, parts, blocks, None if _compiling() else _site(), tuple(sizes),
                          tuple(replicas))


def reduce_scatter(x: torch.Tensor, group, dim: int, blocks: int = 1) -> torch.Tensor:
    """Sum partial results over ``group`` and keep this rank's part along ``dim`` (of each of ``blocks`` equal
    blocks); backward all-gathers the gradient."""
    return _ReduceScatter.apply(x, group, dim, blocks, None if _compiling() else _site())


def gather_to(x: torch.Tensor, group, dim: int, blocks: int = 1) -> torch.Tensor:
    """Enter a tensor-parallel region from a split value: all-gather along ``dim`` forward; backward sums the
    ranks' gradients and keeps this rank's part (a reduce-scatter)."""
    return _GatherTo.apply(x, group, dim, blocks, None if _compiling() else _site())


def shard(x: torch.Tensor, dim: int, index: int, parts: int, blocks: int = 1, sizes: tuple = (),
          replicas: tuple = ()) -> torch.Tensor:
    """Keep part ``index`` of ``parts`` of a tensor that carries no gradient (no communication)."""
    return _take(x, dim, index, parts, blocks, sizes, replicas)


COLLECTIVES = {"copy_to": copy_to, "all_reduce": all_reduce, "all_gather": all_gather, "scatter": scatter,
               "reduce_scatter": reduce_scatter, "gather_to": gather_to, "copy_to_linears": copy_to_linears,
               "sum_replicas": sum_replicas, "linears_regathered": linears_regathered}
__all__ = [*COLLECTIVES, "batch_mean", "shard", "own_part", "own_rows"]
