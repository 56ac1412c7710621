"""Context parallelism at run time: the sequence split over the cp ranks, and attention across the split.

A rank file under ``--cp N`` computes what depends on the inputs alone (position ids, masks, rotary tables, shifted
labels) on the whole sequence, as the model does, then takes this rank's tokens with :func:`cp_enter`; everything
after runs on S/N tokens.  A causal model's sequence is cut into 2N chunks and rank i holds chunks i and 2N-1-i
(Megatron-LM's and torchtitan's load balance), so that every rank does the same attention work: every tensor along
the sequence, on every rank, is in that order (:func:`load_balanced_order`), and each whole value (a mask's key
dimension, an ALiBi bias) is permuted alike, which keeps every position-dependent value exact.

Attention sees the other ranks' keys and values in one of three ways (``--cp-mode``):

=========  ======================================================  =============================================
mode       forward                                                 backward
=========  ======================================================  =============================================
allgather  ``rt.gather_to`` K and V over cp (all-gather); causal:  reduce-scatter of dK and dV (the same call)
           :func:`cp_causal_attention` (chunks, no S x S mask)
ring       :func:`ring_attention_step`: K/V blocks passed to the    dK/dV passed back around the ring, each
           next rank while this block is computed (send/recv);     block's gradient recomputed while they travel
           :func:`merge_attention`: log-sum-exp merge of blocks
a2a        :func:`seq_to_heads` (all-to-all): whole sequence,      the inverse all-to-all of each
           1/N of the heads; :func:`heads_to_seq` back
=========  ======================================================  =============================================

Each function takes the cp process group and reads this rank's index from it, so one rank file serves every cp
rank.  ``fxshard check`` runs them with a stand-in group that has ``rank`` and ``size`` attributes.  Under
``torch.compile`` the ring's send/recv and the all-to-alls run eagerly (:func:`torch.compiler.disable`).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from fxshard.runtime.guard import call_site as _site
from fxshard.runtime.guard import guarded


def _index(group) -> int:
    """This rank's index in ``group`` (a process group, or ``fxshard check``'s stand-in with an int ``rank``)."""
    rank = getattr(group, "rank", None)
    return rank if isinstance(rank, int) else dist.get_rank(group)


def _size(group) -> int:
    size = getattr(group, "size", None)
    return size if isinstance(size, int) else dist.get_world_size(group)


_ORDERS: dict[tuple[int, int, bool], torch.Tensor] = {}


def _order(length: int, parts: int, balanced: bool) -> torch.Tensor:
    """The cp order's positions (:func:`load_balanced_order`), kept per size only when made as a real tensor: one made
    under a fake-tensor or meta trace (the compile's plan and checks run these functions on fake tensors) is that
    trace's, and cached it would reach a later run in the same process, or a worker forked from it (a run after
    ``fxshard.compile`` in one session: its cp forward read a fake tensor, and under --compile it crashed)."""
    key = (length, parts, balanced)
    order = _ORDERS.get(key) if isinstance(length, int) else None
    if order is not None:
        return order
    if not balanced:
        order = torch.arange(length)
    else:
        chunk = length // (2 * parts)
        starts = [c for r in range(parts) for c in (r, 2 * parts - 1 - r)]
        order = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in starts])
    if isinstance(length, int) and type(order) is torch.Tensor and not order.is_meta and len(_ORDERS) < 64:
        _ORDERS[key] = order
    return order


def load_balanced_order(length: int, parts: int, balanced: bool = True) -> torch.Tensor:
    """The positions of a sequence of ``length`` in the order the ``parts`` cp ranks hold them: rank i holds chunks
    i and 2*parts-1-i of 2*parts (``balanced``, causal models), or chunk i of parts::

        >>> load_balanced_order(8, 2).tolist(), load_balanced_order(8, 2, balanced=False).tolist()
        ([0, 1, 6, 7, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7])
    """
    return _order(length, parts, balanced).clone()


def _permuted(x: torch.Tensor, dims, parts: int, balanced: bool) -> torch.Tensor:
    for d in dims:
        x = x.index_select(d, _order(x.shape[d], parts, balanced).to(x.device))
    return x


def _unpermuted(x: torch.Tensor, dim: int, parts: int, balanced: bool) -> torch.Tensor:
    order = _order(x.shape[dim], parts, balanced)
    return x.index_select(dim, torch.argsort(order).to(x.device))


def cp_enter(x: torch.Tensor, group, dims: tuple = (), split: int | None = None, balanced: bool = True) -> torch.Tensor:
    """A value computed from the inputs alone, on the whole sequence, as this rank's split program takes it: each of
    ``dims`` (a sequence dimension) permuted into the cp ranks' order, then this rank's part along ``split`` (None:
    the whole value).  No gradient flows into inputs, and nothing is communicated."""
    parts = _size(group)
    x = _permuted(x, dims, parts, balanced)
    if split is not None:
        size = x.shape[split] // parts
        x = x.narrow(split, _index(group) * size, size)
    return x.contiguous()


def cp_causal_mask(query: torch.Tensor, group, keys: int, balanced: bool = True, block: int | None = None
                   ) -> torch.Tensor:
    """``[S/N, keys]`` booleans, True where this rank's query may attend: key position <= query position, positions
    in the cp order (:func:`load_balanced_order`); ``block``: only the keys cp rank ``block`` holds.  Replaces
    ``is_causal=True``, which means the top-left triangle and so only holds for the whole sequence."""
    parts, index = _size(group), _index(group)
    rows = query.shape[-2]
    length = rows * parts
    order = _order(length, parts, balanced).to(query.device)
    q = order[index * rows:(index + 1) * rows]
    k = order if block is None else order[block * rows:(block + 1) * rows]
    k = k[:keys] if block is None else k
    return q[:, None] >= k[None, :]


# ---------------------------------------------------------------- causal attention in blocks (allgather)

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _flash(q, k, v, causal: bool, scale: float):
    """SDPA's fused CPU kernel with its log-sum-exp (no S x S tensor): ``(out, lse)``; elsewhere ``_block`` (exact,
    its scores made for the block and freed)."""
    if q.device.type in ("cpu", "meta"):
        return _FLASH(q, k, v, 0.0, causal, scale=scale)
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril() if causal else None
    out, lse = _block(q, k, v, mask, scale, 1)
    return out.to(q.dtype), lse


def _pieces(starts: tuple, size: int):
    """Per query chunk (``size`` rows from position ``start``): its row offset in the query and the key blocks it
    sees: the keys before it, every one visible (none for the first chunk), and its own chunk, causally."""
    for j, start in enumerate(starts):
        blocks = ([(0, start, False)] if start else []) + [(start, size, True)]
        yield j * size, blocks


class _CausalChunks(torch.autograd.Function):
    """Causal attention of query chunks at known positions over keys in the natural order, block by block, merged by
    log-sum-exp; backward by the kernel's own backward of each block given the merged output and log-sum-exp (the
    FlashAttention identity), so nothing of size S x S is made or saved."""

    @staticmethod
    def forward(ctx, q, k, v, starts, size, scale):
        outs, lses = [], []
        for row, blocks in _pieces(starts, size):
            qj = q.narrow(-2, row, size)
            parts = [_flash(qj, k.narrow(-2, a, n), v.narrow(-2, a, n), causal, scale) for a, n, causal in blocks]
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
            outs.append(sum(torch.exp(p[1] - lse).unsqueeze(-1) * p[0].float() for p in parts).to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.starts, ctx.size, ctx.scale = starts, size, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if q.device.type not in ("cpu", "meta"):
            return _recomputed_grads(ctx, q, k, v, dout) + (None, None, None)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dout = dout.contiguous()
        for row, blocks in _pieces(ctx.starts, ctx.size):
            rows = (row, ctx.size)
            qj, oj, gj = q.narrow(-2, *rows), out.narrow(-2, *rows), dout.narrow(-2, *rows)
            lj = lse.narrow(-1, *rows)
            for a, n, causal in blocks:
                g = _FLASH_BACKWARD(gj, qj, k.narrow(-2, a, n), v.narrow(-2, a, n), oj, lj, 0.0, causal,
                                    scale=ctx.scale)
                dq.narrow(-2, *rows).add_(g[0])
                dk.narrow(-2, a, n).add_(g[1])
                dv.narrow(-2, a, n).add_(g[2])
        return dq, dk, dv, None, None, None


def _recomputed_grads(ctx, q, k, v, dout):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _CausalChunks.forward(_Scratch(), *leaves, ctx.starts, ctx.size, ctx.scale)
        return torch.autograd.grad(out, leaves, dout)


class _Scratch:
    def save_for_backward(self, *_):
        pass


@torch.compiler.disable  # as the ring's and the all-to-alls': the blocks' kernels run eagerly under --compile
def cp_causal_attention(query: torch.Tensor, group, key: torch.Tensor, value: torch.Tensor, scale: float,
                        balanced: bool = True) -> torch.Tensor:
    """Causal attention of this cp rank's queries (``[.., S/N, d]``, in the cp order) over every key and value
    (``[.., S, d]``, all-gathered, in the cp order), with no S x S mask: each of this rank's load-balanced chunks
    attends over the chunks before it unmasked and over itself with ``is_causal``, merged by log-sum-exp.  Query
    heads per key/value head (grouped-query attention) are repeated here."""
    parts, index = _size(group), _index(group)
    rows = query.shape[-2]
    length = rows * parts
    if key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    key, value = (_unpermuted(t, t.dim() - 2, parts, balanced) for t in (key, value))
    if balanced:
        size = length // (2 * parts)
        starts = (index * size, (2 * parts - 1 - index) * size)
    else:
        size, starts = rows, (index * rows,)
    return _CausalChunks.apply(query, key, value, starts, size, scale)


# ---------------------------------------------------------------- ring


def _block(q, k, v, mask, scale: float, kv_groups: int):
    """Attention of ``q`` over one block of keys: the output and the log-sum-exp of each query's scores, in fp32.
    A query with no key to see in the block has output 0 and log-sum-exp -inf (the merge gives it no weight)."""
    if kv_groups > 1:  # transformers' repeat_kv: head h reads key/value head h // groups
        k, v = k.repeat_interleave(kv_groups, dim=-3), v.repeat_interleave(kv_groups, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    out = torch.matmul(torch.exp(scores - safe.unsqueeze(-1)), v.float())
    return out, lse


def _causal_pieces(index: int, source: int, parts: int, rows: int, balanced: bool):
    """How this rank's query chunks see the key chunks cp rank ``source`` holds, under a causal mask: ``(size,
    [(query row, [(key row, is_causal), ..]), ..])``.  A key chunk before a query chunk is seen whole, the chunk
    itself causally (``is_causal``), a later one not at all: no mask is made."""
    if balanced:
        size, mine, theirs = rows // 2, (index, 2 * parts - 1 - index), (source, 2 * parts - 1 - source)
    else:
        size, mine, theirs = rows, (index,), (source,)
    return size, [(a * size, [(b * size, kb == qa) for b, kb in enumerate(theirs) if kb <= qa])
                  for a, qa in enumerate(mine)]


def _repeat_kv(k, v, groups: int):
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)


def _unrepeat(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of a key/value head repeated ``groups`` times (``repeat_interleave``): its repeats' summed."""
    if groups == 1:
        return grad
    b, heads, length, width = grad.shape
    return grad.view(b, heads // groups, groups, length, width).sum(2)


def _causal_block(q, k, v, pieces, scale: float, kv_groups: int):
    """:func:`_block` of a causal ring block, chunk by chunk with SDPA's fused kernel (``is_causal`` on the diagonal
    chunk, nothing on the others): ``(out, lse)`` in fp32; a query chunk with no key to see has 0 and -inf."""
    size, chunks = pieces
    k, v = _repeat_kv(k, v, kv_groups)
    outs, lses = [], []
    for row, keys in chunks:
        qj = q.narrow(-2, row, size)
        parts = [_flash(qj, k.narrow(-2, col, size), v.narrow(-2, col, size), causal, scale) for col, causal in keys]
        if not parts:
            outs.append(torch.zeros(qj.shape, dtype=torch.float32, device=q.device))
            lses.append(torch.full(qj.shape[:-1], float("-inf"), device=q.device))
            continue
        lse = torch.logsumexp(torch.stack([p[1].float() for p in parts]), dim=0)
        outs.append(sum(torch.exp(p[1] - lse).unsqueeze(-1) * p[0].float() for p in parts))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _causal_block_grads(q, k, v, out, lse, dout, dlse, pieces, scale: float, kv_groups: int):
    """The gradients of :func:`_causal_block` by the fused kernel's own backward, given the block's ``out`` and
    ``lse``: the FlashAttention identity, with the gradient of ``lse`` carried by one more column (q, k and v get a
    zero, ``dout`` a one and ``out`` ``-dlse``: the kernel's row sum of ``dout * out`` becomes ``D - dlse``)."""
    size, chunks = pieces
    kr, vr = _repeat_kv(k, v, kv_groups)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = torch.zeros_like(lse) if dlse is None else dlse

    def column(t, end):
        return torch.cat([t, end.to(t.dtype).expand(*t.shape[:-1], 1)], dim=-1).contiguous()

    zero = q.new_zeros(())
    for row, keys in chunks:
        rows = (row, size)
        qj = column(q.narrow(-2, *rows), zero)
        oj = column(out.narrow(-2, *rows).to(q.dtype), -dlse.narrow(-1, *rows).unsqueeze(-1))
        gj = column(dout.narrow(-2, *rows).to(q.dtype), q.new_ones(()))
        lj = lse.narrow(-1, *rows).contiguous()
        for col, causal in keys:
            kc, vc = (column(t.narrow(-2, col, size), zero) for t in (kr, vr))
            g = _FLASH_BACKWARD(gj, qj, kc, vc, oj, lj, 0.0, causal, scale=scale)
            dq.narrow(-2, *rows).add_(g[0][..., :-1])
            dk.narrow(-2, col, size).add_(g[1][..., :-1])
            dv.narrow(-2, col, size).add_(g[2][..., :-1])
    return dq, _unrepeat(dk, kv_groups), _unrepeat(dv, kv_groups)


def _block_mask(mask, query, group, step: int, causal: bool, balanced: bool):
    """The mask of the keys this rank holds at ring ``step`` (they came from cp rank index - step)."""
    parts, index = _size(group), _index(group)
    source = (index - step) % parts
    if causal:
        return cp_causal_mask(query, group, query.shape[-2] * parts, balanced, block=source)
    if mask is None:
        return None
    width = mask.shape[-1] // parts
    return mask.narrow(-1, source * width, width) if mask.shape[-1] > 1 else mask


def _neighbours(group) -> tuple[int, int]:
    parts, index = _size(group), _index(group)
    return dist.get_global_rank(group, (index + 1) % parts), dist.get_global_rank(group, (index - 1) % parts)


def _start_shift(tensors, group, to_next: bool):
    """Send ``tensors`` one rank along the ring (to the next rank, or back to the previous) and receive the same
    shapes from the other side; returns the receive buffers and the requests to wait for."""
    nxt, prev = _neighbours(group)
    to, frm = (nxt, prev) if to_next else (prev, nxt)
    tensors = [t.contiguous() for t in tensors]
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to, group) for t in tensors] + [dist.P2POp(dist.irecv, b, frm, group)
                                                                        for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


class _RingStep(torch.autograd.Function):
    """One ring step: start passing K/V on, attend over the K/V held now, wait.  Backward: start passing the
    gradient of the received K/V back, recompute this block's gradient meanwhile, wait and add the gradient of the
    K/V this rank sent, which the next rank passes back."""

    @staticmethod
    def forward(ctx, q, k, v, mask, group, step, causal, scale, kv_groups, send, balanced, site):
        ctx.group, ctx.step, ctx.causal, ctx.scale, ctx.kv_groups = group, step, causal, scale, kv_groups
        ctx.send, ctx.balanced, ctx.site = send, balanced, site
        # causal: the block's chunks seen whole, causally or not at all, no [S/N, S/N] mask (_causal_pieces)
        parts, index = _size(group), _index(group)
        ctx.pieces = _causal_pieces(index, (index - step) % parts, parts, q.shape[-2], balanced) if causal else None
        block_mask = None if causal else _block_mask(mask, q, group, step, causal, balanced)
        with guarded("send/recv of K/V around the cp ring", group, k, site):
            pending = _start_shift([k, v], group, to_next=True) if send else None
            if causal:
                out, lse = _causal_block(q, k, v, ctx.pieces, scale, kv_groups)
            else:
                out, lse = _block(q, k, v, block_mask, scale, kv_groups)
            if pending is not None:
                for work in pending[1]:
                    work.wait()
        fused = causal and q.device.type == "cpu"  # backward by the fused kernel, given the block's out and lse
        ctx.save_for_backward(q, k, v, block_mask, *((out, lse) if fused else ()))
        received = pending[0] if pending is not None else []
        return (out, lse, *received)

    @staticmethod
    def backward(ctx, dout, dlse, *dreceived):
        q, k, v, block_mask, *block = ctx.saved_tensors
        pending = None
        with guarded("send/recv of dK/dV around the cp ring (backward)", ctx.group, k, ctx.site):
            if ctx.send:
                grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(dreceived, (k, v), strict=True)]
                pending = _start_shift(grads, ctx.group, to_next=False)
            if block:
                dq, dk, dv = _causal_block_grads(q, k, v, *block, dout, dlse, ctx.pieces, ctx.scale, ctx.kv_groups)
            else:
                dq, dk, dv = _recomputed_block_grads(ctx, q, k, v, block_mask, dout, dlse)
            if pending is not None:
                for work in pending[1]:
                    work.wait()
                dk, dv = dk + pending[0][0], dv + pending[0][1]
        return dq, dk, dv, *([None] * 9)


def _recomputed_block_grads(ctx, q, k, v, block_mask, dout, dlse):
    """The gradients of a ring block, its attention recomputed under autograd (zeros for an input it did not read)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        if ctx.pieces is not None:
            out, lse = _causal_block(*leaves, ctx.pieces, ctx.scale, ctx.kv_groups)
        else:
            out, lse = _block(*leaves, block_mask, ctx.scale, ctx.kv_groups)
        outs = [(o, g) for o, g in ((out, dout), (lse, dlse)) if g is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in outs], leaves, [g for _, g in outs],
                                    allow_unused=True) if outs else (None,) * 3
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v), strict=True))


@torch.compiler.disable
def ring_attention_step(key: torch.Tensor, group, value: torch.Tensor, query: torch.Tensor,
                        mask: torch.Tensor | None = None, step: int = 0, causal: bool = False, scale: float = 1.0,
                        kv_groups: int = 1, balanced: bool = True) -> tuple[torch.Tensor, ...]:
    """Ring step ``step`` of attention over the cp ranks: ``query`` attends over the ``key``/``value`` block held
    now (this rank's own at step 0) while the block travels on to the next rank, which returns as the next step's.
    Returns ``(out, lse, next_key, next_value)``: the block's output and log-sum-exp in fp32 (for
    :func:`merge_attention`) and the block received from the previous rank.  ``mask``: ``[.., S/N, S]`` over all
    keys in the cp order (the columns of the block's source rank are used); ``causal``: the mask made from
    positions instead; ``kv_groups``: query heads per key/value head (grouped-query attention, repeated here, after
    the transfer)."""
    return _RingStep.apply(query, key, value, mask, group, step, causal, scale, kv_groups, True, balanced, _site())


@torch.compiler.disable
def ring_attention_last(key: torch.Tensor, group, value: torch.Tensor, query: torch.Tensor,
                        mask: torch.Tensor | None = None, step: int = 0, causal: bool = False, scale: float = 1.0,
                        kv_groups: int = 1, balanced: bool = True) -> tuple[torch.Tensor, ...]:
    """The ring's last step (:func:`ring_attention_step` that passes nothing on): ``(out, lse)``."""
    return _RingStep.apply(query, key, value, mask, group, step, causal, scale, kv_groups, False, balanced, _site())


def merge_attention(outs: list, lses: list, dtype: torch.dtype) -> torch.Tensor:
    """Exact softmax attention from blocks over disjoint keys: each block's output weighted by exp(its
    log-sum-exp - the total log-sum-exp), in ``dtype``."""
    stacked = torch.stack(list(lses))
    total = torch.logsumexp(stacked, dim=0)
    safe = total.masked_fill(torch.isneginf(total), 0.0)
    out = sum(torch.exp(lse - safe).unsqueeze(-1) * o for o, lse in zip(outs, lses, strict=True))
    return out.to(dtype)


# ---------------------------------------------------------------- all-to-all (Ulysses) and outputs


def _exchange(x: torch.Tensor, group, split: int, join: int, what: str, site) -> torch.Tensor:
    """Part j of ``x`` along ``split`` to cp rank j; the parts received, in rank order, joined along ``join``."""
    parts = _size(group)
    chunks = torch.stack(x.chunk(parts, dim=split)).contiguous()
    out = torch.empty_like(chunks)
    with guarded(what, group, x, site):
        dist.all_to_all_single(out, chunks, group=group)
    return torch.cat(list(out.unbind(0)), dim=join)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, head_dim, seq_dim, balanced, site):
        ctx.args = (group, head_dim, seq_dim, balanced, site)
        return _to_heads(x, group, head_dim, seq_dim, balanced, site)

    @staticmethod
    def backward(ctx, grad):
        return _to_seq(grad, *ctx.args), None, None, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, head_dim, seq_dim, balanced, site):
        ctx.args = (group, head_dim, seq_dim, balanced, site)
        return _to_seq(x, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, *ctx.args), None, None, None, None, None


def _to_heads(x, group, head_dim, seq_dim, balanced, site):
    whole = _exchange(x, group, head_dim, seq_dim, "all_to_all (sequence to heads)", site)
    return _unpermuted(whole, seq_dim, _size(group), balanced).contiguous()


def _to_seq(x, group, head_dim, seq_dim, balanced, site):
    x = _permuted(x, (seq_dim,), _size(group), balanced)
    return _exchange(x, group, seq_dim, head_dim, "all_to_all (heads to sequence)", site)


@torch.compiler.disable
def seq_to_heads(x: torch.Tensor, group, head_dim: int = 1, seq_dim: int = 2, balanced: bool = True) -> torch.Tensor:
    """Ulysses: ``[.., H, S/N, d]`` split over the sequence -> ``[.., H/N, S, d]``, the whole sequence in its natural
    order and 1/N of the heads (an all-to-all over cp); backward the inverse."""
    return _SeqToHeads.apply(x, group, head_dim, seq_dim, balanced, _site())


@torch.compiler.disable
def heads_to_seq(x: torch.Tensor, group, head_dim: int = 1, seq_dim: int = 2, balanced: bool = True) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[.., H/N, S, d]`` -> ``[.., H, S/N, d]`` in the cp order."""
    return _HeadsToSeq.apply(x, group, head_dim, seq_dim, balanced, _site())


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, balanced, site):
        ctx.group, ctx.dim, ctx.balanced = group, dim, balanced
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_size(group))]
        with guarded("all_gather (a returned value, whole)", group, x, site):
            dist.all_gather(parts, x.contiguous(), group=group)
        return _unpermuted(torch.cat(parts, dim=dim), dim, len(parts), balanced)

    @staticmethod
    def backward(ctx, grad):
        mine = _permuted(grad, (ctx.dim,), _size(ctx.group), ctx.balanced)
        size = mine.shape[ctx.dim] // _size(ctx.group)
        return mine.narrow(ctx.dim, _index(ctx.group) * size, size), None, None, None, None


def cp_leave(x: torch.Tensor, group, dim: int, balanced: bool = True) -> torch.Tensor:
    """A value split over the sequence, whole and in the natural order (the model's other outputs, returned):
    all-gather along ``dim`` over cp, then undo the cp order.  Backward keeps this rank's part."""
    return _Leave.apply(x, group, dim, balanced, _site())


__all__ = ["cp_causal_attention", "cp_causal_mask", "cp_enter", "cp_leave", "heads_to_seq", "load_balanced_order",
           "merge_attention",
           "ring_attention_last", "ring_attention_step", "seq_to_heads"]
