"""Dropout whose mask does not depend on the layout: counter-based, keyed by what an element *is*.

Torch's dropout draws its mask from a generator whose state depends on everything drawn before on
that device, so a mask changes with the tensor-parallel slice, the pipeline stage, the dp rank and
the microbatch.  Here the keep decision of one element is a hash of

    (seed, batch number, site, global sample index, index of the element within its sample)

compared with ``p``: the batch number counts forward batches over the run, ``site`` numbers the
dropout calls of one forward in order, the sample index counts rows of the *whole* batch (all dp
ranks and microbatches), and the element index is taken in the *unsharded* tensor.  Every rank
computes the decisions of just the elements it holds, and they are the single-device ones.  The
output is ``x * keep / (1 - p)``, torch's formula.

Generated code calls :func:`dropout` with its site and, for a tp-sharded value, which slice this
rank holds; the training loop calls :func:`begin_batch` before each batch, pipeline stages call
:func:`begin_microbatch`; :class:`ReferenceDropout` gives an unmodified model the same masks::

    begin_batch(seed=0, number=0)
    y = dropout(x, 0.1, site=0)                                  # single device
    y0 = dropout(x.chunk(2, -1)[0], 0.1, site=0, shard=(x.dim() - 1, 0, 2))
    assert torch.equal(y0, y.chunk(2, -1)[0])                    # tp rank 0 of 2: the same elements
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from fxshard.runtime.slices import part_ranges

_M32 = 0xFFFFFFFF
_SALT = 0x2545F491  # separates these hashes from other uses of the same mixer


@dataclass
class BatchContext:
    """Where the rows of the tensors in the current forward sit in the whole run."""

    seed: int = 0
    number: int = 0  # forward batches since the start of training: (step - 1) * grad_accum + k
    first_row: int = 0  # row of the full batch where this rank's share starts (dp offset)
    microbatch: int = 0  # index of the pipeline microbatch being computed (0 without pipelining)
    training: bool = True  # False: an evaluation's forward, where dropout keeps every element


_context = BatchContext()


def begin_batch(seed: int, number: int, first_row: int = 0, training: bool = True) -> None:
    """Before each batch's forward: the run's seed, the batch number, this dp rank's first row; ``training=False``
    before an evaluation's forward (no dropout, as ``model.eval()``)."""
    global _context
    _context = BatchContext(seed, number, first_row, 0, training)


def begin_microbatch(index: int) -> None:
    """Before a pipeline stage computes microbatch ``index`` of the current batch."""
    _context.microbatch = index


def local_rows(leaves) -> int:
    """Rows (dim 0) of the first tensor of a batch: this dp rank's share."""
    return next((int(v.shape[0]) for v in leaves if isinstance(v, torch.Tensor) and v.dim() > 0), 0)


def _mix(x):
    """``lowbias32``: a 32-bit integer hash (int64 tensors or Python ints; products keep their low 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` in place: the per-element pass holds one int64 temporary instead of two."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def _absorb(h, v):
    """Fold a non-negative 64-bit ``v`` into the hash ``h``, both halves."""
    h = _mix(h ^ (v & _M32))
    return _mix(h ^ ((v >> 32) & _M32))


def _coords(size: int, dim: int, shard, device) -> tuple[torch.Tensor, int]:
    """Global coordinates along ``dim`` of the ``size`` local positions, and the global size of ``dim``."""
    if shard is None or shard[0] != dim:
        return torch.arange(size, device=device, dtype=torch.int64), size
    _, index, parts, *blocks = shard
    full = size * parts
    ranges = part_ranges(full, index, parts, blocks[0] if blocks else 1)  # what the local positions hold, in order
    return torch.cat([torch.arange(a, b, device=device, dtype=torch.int64) for a, b in ranges]), full


def keep_mask(shape, p: float, site: int, shard=None, device=None, whole: bool = False) -> torch.Tensor:
    """Boolean keep decisions of a local tensor of ``shape`` (see the module docstring).

    ``shard = (dim, index, parts[, blocks])``: the tensor is part ``index`` of ``parts`` along ``dim``
    of the global one (inside each of ``blocks`` packed blocks); ``None``: the whole tensor.  ``whole``: its rows
    are the whole batch's, not this rank's part (a value computed on the whole batch, ``passes/batch_rows.py``)."""
    ctx = _context
    shape = tuple(shape) or (1,)
    rows, global_rows = _coords(shape[0], 0, shard, device)
    if not whole:
        rows = rows + ctx.first_row + ctx.microbatch * global_rows  # microbatches split the rows in order
    prefix = _absorb(_absorb(_absorb(_SALT, ctx.seed), ctx.number), site)
    h_rows = _absorb(prefix, rows)
    # index of each element within its sample, in the unsharded tensor: local coordinates mapped to
    # global ones per dimension, combined with the global strides by broadcasting
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    nd = len(shape)
    for d in range(nd - 1, 0, -1):
        c, full = _coords(shape[d], d, shard, device)
        index = index + (c * stride).view([-1] + [1] * (nd - 1 - d))
        stride *= full
    h = _mix((index & _M32) ^ _SALT)  # hash of the element index alone, shared by all rows
    if stride > _M32:
        h = _mix(h ^ (index >> 32))
    h = _mix_(h ^ h_rows.view([-1] + [1] * (nd - 1)))
    threshold = min(int(round(p * 2.0**32)), 2**32)
    return h >= threshold


def dropout(x: torch.Tensor, p: float, site: int, shard=None, inplace: bool = False, whole: bool = False
            ) -> torch.Tensor:
    """``x * keep / (1 - p)`` with the layout-invariant mask of dropout number ``site`` of the forward.

    >>> begin_batch(seed=0, number=0); y = dropout(torch.ones(4, 8), 0.5, site=0)   # doctest: +SKIP
    """
    if p == 0 or not _context.training:
        return x
    if p == 1:
        return x.mul_(0) if inplace else x * 0
    noise = keep_mask(x.shape, p, site, shard, x.device, whole).view(x.shape).to(x.dtype).div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


class ReferenceDropout(TorchFunctionMode):
    """Single-device dropout with the masks of compiled programs: ``F.dropout`` / ``torch.dropout`` calls
    in training mode become :func:`dropout`, numbered in call order (one instance per forward)."""

    def __init__(self):
        super().__init__()
        self.site = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            x, p, training, inplace = _bind(args, kwargs, ("input", 0.5), ("p", 0.5), ("training", True),
                                            ("inplace", False))
        elif func in (torch.dropout, torch.dropout_):
            x, p, training = _bind(args, kwargs, ("input", None), ("p", None), ("train", None))
            inplace = func is torch.dropout_
        else:
            return func(*args, **kwargs)
        if not training:
            return func(*args, **kwargs)
        site, self.site = self.site, self.site + 1
        return dropout(x, p, site, inplace=inplace)


def _bind(args, kwargs, *params):
    return [args[i] if i < len(args) else kwargs.get(name, default) for i, (name, default) in enumerate(params)]
