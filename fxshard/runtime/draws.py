"""Random draws whose values do not depend on the layout: each element keyed by its place in one device's tensor.

Dropout's masks (:mod:`fxshard.runtime.random`) are hashes of what an element *is*; every other random op of a
forward is drawn the same way: a masked autoencoder's patch noise (``rand`` then ``argsort``), ``randn`` noise,
``randperm``, ``bernoulli_``, a router's ``exponential_``, stochastic depth.  Element ``i`` of the tensor op number
``site`` draws on one device gets the 32-bit hash of

    (seed, batch number, site, stream, i)

``i`` its flat index in the single-device tensor, ``stream`` 0 or 1 where an element needs two hashes (a normal's
Box-Muller pair).  A rank draws only the elements it holds: ``rows`` says which dimension holds the batch's rows and
how the step's batch is cut (dp ranks x microbatches, in order; the part is read at run time from
:func:`~fxshard.runtime.random.begin_batch` / ``begin_microbatch``), ``shard`` which tp slice it holds, exactly as
dropout's.  The hashes become the op's distribution in float64 and are cast to its dtype; an op's other arguments
(a Bernoulli's probabilities, a normal's means) are the rank's own values.  :func:`draw` takes the ATen op and its
arguments, so generated code names the op it replaces, and :class:`ReferenceDraws` gives an unmodified model the
same values::

    begin_batch(seed=0, number=0)
    u = draw(torch.ops.aten.rand.default, [4, 8], site=0)              # one device, the whole batch of 4
    u1 = draw(torch.ops.aten.rand.default, [2, 8], site=0, rows=(0, 2, 2))
    assert torch.equal(u1, u[:2])                                      # dp rank 0 of 2: rows 0 and 1
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxshard.runtime import random as rt_random
from fxshard.runtime.random import _M32, _absorb, _coords, _mix, _mix_
from fxshard.runtime.slices import part_ranges

aten = torch.ops.aten
_SALT = 0x5851F42D  # these hashes apart from dropout's masks
_TWO32 = 2.0 ** 32


def hashes(shape, site: int, stream: int = 0, rows=None, shard=None, device=None) -> torch.Tensor:
    """The int64 hashes (< 2**32) of a local tensor of ``shape``: each element's key in the single-device tensor.

    ``rows = (dim, rows, parts[, blocks])``: ``dim`` holds a part of the step's batch of ``parts`` parts of ``rows``
    rows each (this rank's part from the batch context); ``shard = (dim, index, parts[, blocks])``: a tp slice."""
    ctx = rt_random._context
    shape = tuple(int(s) for s in shape)
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        if rows is not None and rows[0] == d:
            part = ctx.first_row // rows[1] + ctx.microbatch
            full = shape[d] * rows[2]
            spans = part_ranges(full, part, rows[2], rows[3] if len(rows) > 3 else 1)
            c = torch.cat([torch.arange(a, b, device=device, dtype=torch.int64) for a, b in spans])
        else:
            c, full = _coords(shape[d], d, shard, device)
        index = index + (c * stride).view([-1] + [1] * (len(shape) - 1 - d))
        stride *= full
    index = index.expand(shape) if shape else index
    prefix = _absorb(_absorb(_absorb(_absorb(_SALT, ctx.seed), ctx.number), site), stream)
    h = _mix((index & _M32) ^ prefix)
    if stride > _M32:
        h = _mix_(h ^ (index >> 32))
    return h


def _uniform(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[0, 1) with as many bits as ``dtype`` holds exactly (so the cast never rounds up to 1)."""
    bits = min(_mantissa(dtype), 32) if dtype.is_floating_point else 32
    return (h >> (32 - bits)).to(torch.float64) * 2.0 ** -bits


def _mantissa(dtype: torch.dtype) -> int:
    """The significant bits of a floating dtype (24 for float32)."""
    return 1 - int(math.log2(torch.finfo(dtype).eps))


def _open(h: torch.Tensor) -> torch.Tensor:
    """(0, 1) in float64: never 0, never 1 (a logarithm of it is finite)."""
    return (h.to(torch.float64) + 0.5) / _TWO32


def _normal(keys) -> torch.Tensor:
    """Standard normal in float64 (Box-Muller of two streams)."""
    u1, u2 = _open(keys(0)), keys(1).to(torch.float64) / _TWO32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def _integers(keys, low: int, high: int) -> torch.Tensor:
    """Integers in [low, high) from 63 bits of two streams."""
    bits = ((keys(0) & 0x7FFFFFFF) << 32) | keys(1)
    return low + torch.remainder(bits, high - low)


def _bind(func, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in (``normal(mean)``'s std of 1)."""
    bound = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value() and a.name not in _OPTIONS:  # a dtype's default is the schema's enum number
            bound[a.name] = a.default_value
    return bound


_OPTIONS = {"dtype", "layout", "device", "pin_memory", "memory_format", "generator"}


def _dtype(a: dict, like=None) -> torch.dtype:
    dtype = a.get("dtype")
    return dtype if dtype is not None else like.dtype if like is not None else torch.get_default_dtype()


def _draws(func, a: dict, keys_of):
    """The op's value from its bound arguments ``a``: ``keys_of(shape, device)(stream)`` gives the hashes of a tensor
    of ``shape``."""
    packet = func.overloadpacket
    if packet in (aten.rand, aten.randn, aten.randint, aten.randperm) or func is aten.normal.float_float:
        size = [a["n"]] if packet is aten.randperm else a["size"]
        keys = keys_of(size, a.get("device"))
        if packet is aten.rand:
            return _uniform(keys(0), _dtype(a)).to(_dtype(a))
        if packet is aten.randn:
            return _normal(keys).to(_dtype(a))
        if packet is aten.normal:
            return (a["mean"] + a["std"] * _normal(keys)).to(_dtype(a))
        if packet is aten.randint:
            return _integers(keys, a.get("low", 0), a["high"]).to(a.get("dtype") or torch.int64)
        bits = ((keys(0) & 0x7FFFFFFF) << 32) | keys(1)
        return torch.argsort(bits, stable=True).to(a.get("dtype") or torch.int64)
    if packet in _LIKE:
        x = a["self"]
        keys = keys_of(x.shape, a.get("device") or x.device)
        dtype = _dtype(a, x)
        if packet is aten.randint_like:
            return _integers(keys, a.get("low", 0), a["high"]).to(dtype)
        return (_uniform(keys(0), dtype) if packet is aten.rand_like else _normal(keys)).to(dtype)
    if packet in _IN_PLACE:
        x = a["self"]
        return x.copy_(_IN_PLACE[packet](keys_of(x.shape, x.device), x, a))
    if packet is aten.bernoulli:
        x = a["self"]
        p = a.get("p", x)
        p = p.to(torch.float64) if isinstance(p, torch.Tensor) else p
        return (_uniform(keys_of(x.shape, x.device)(0), torch.float64) < p).to(x.dtype)
    if packet is aten.normal:  # a tensor of means or of standard deviations: the broadcast shape
        mean, std = a["mean"], a["std"]
        like = mean if isinstance(mean, torch.Tensor) else std
        shape = torch.broadcast_shapes(*(t.shape for t in (mean, std) if isinstance(t, torch.Tensor)))
        return mean + std * _normal(keys_of(shape, like.device)).to(like.dtype)
    if packet is aten.multinomial:
        return _multinomial(keys_of, a["self"], a["num_samples"], a.get("replacement", False))
    raise NotImplementedError(func)


def _probability(p):
    return p.to(torch.float64) if isinstance(p, torch.Tensor) else p


def _random_(keys, x, a):
    low, high = a.get("from", 0), a.get("to")
    if high is None:
        high = 2 ** _mantissa(x.dtype) + 1 if x.dtype.is_floating_point else torch.iinfo(x.dtype).max
    return _integers(keys, low, high).to(x.dtype)


_IN_PLACE = {
    aten.bernoulli_: lambda keys, x, a: (_uniform(keys(0), torch.float64) < _probability(a.get("p", 0.5))).to(x.dtype),
    aten.uniform_: lambda keys, x, a: (a["from"] + (a["to"] - a["from"]) * _uniform(keys(0), x.dtype)).to(x.dtype),
    aten.random_: _random_,
    aten.normal_: lambda keys, x, a: (a["mean"] + a["std"] * _normal(keys)).to(x.dtype),
    aten.exponential_: lambda keys, x, a: (-torch.log(_open(keys(0))) / a["lambd"]).to(x.dtype),
    aten.cauchy_: lambda keys, x, a: (a["median"] + a["sigma"] * torch.tan(math.pi * (_open(keys(0)) - 0.5))).to(
        x.dtype),
    aten.log_normal_: lambda keys, x, a: torch.exp(a["mean"] + a["std"] * _normal(keys)).to(x.dtype),
    aten.geometric_: lambda keys, x, a: torch.ceil(torch.log(_open(keys(0))) / math.log1p(-a["p"])).to(x.dtype),
}
_LIKE = {aten.rand_like, aten.randn_like, aten.randint_like}


def _multinomial(keys_of, probs, num_samples: int, replacement: bool):
    """Each row of ``probs`` (one row: a 1-d ``probs``) drawn from as torch draws: with replacement, a uniform
    per sample through the cumulative probabilities; without, the ``num_samples`` smallest exponential races
    ``E / p`` (the order sampling without replacement picks them in)."""
    p = probs.to(torch.float64)
    if replacement:
        keys = keys_of((*probs.shape[:-1], num_samples), probs.device)
        cdf = p.cumsum(-1)
        u = _uniform(keys(0), torch.float64) * cdf[..., -1:]
        return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
    race = -torch.log(_open(keys_of(probs.shape, probs.device)(0))) / p
    return torch.topk(race, num_samples, dim=-1, largest=False, sorted=True).indices


DRAWS = frozenset({aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low,
                   aten.normal.float_float, aten.randperm.default, aten.rand_like.default, aten.randn_like.default,
                   aten.randint_like.default, aten.randint_like.low_dtype, aten.bernoulli_.float,
                   aten.bernoulli_.Tensor, aten.uniform_.default, aten.random_.default, aten.random_.to,
                   getattr(aten.random_, "from"), aten.normal_.default, aten.exponential_.default, aten.cauchy_.default,
                   aten.log_normal_.default, aten.geometric_.default, aten.bernoulli.default, aten.bernoulli.p,
                   aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
                   aten.multinomial.default})
"""The random ops :func:`draw` draws as one device does (the rest keep torch's generator)."""


def draw(func, *args, site: int, rows=None, shard=None, **kwargs):
    """What ``func(*args, **kwargs)`` (an op of :data:`DRAWS`) draws on one device, for the elements this rank holds:
    ``rows`` its part of the batch, ``shard`` its tp slice (see :func:`hashes`).

    >>> begin_batch(seed=0, number=0); x = draw(torch.ops.aten.randn.default, [2, 3], site=1)   # doctest: +SKIP
    """
    def keys_of(shape, device):
        return lambda stream: hashes(shape, site, stream, rows, shard, device)
    return _draws(func, _bind(func, args, kwargs), keys_of)


class ReferenceDraws(TorchDispatchMode):
    """Single-device draws with the values of compiled programs: every op of :data:`DRAWS` a forward runs is drawn by
    :func:`draw`, numbered in call order (one instance per forward) as the compile numbers them in graph order."""

    def __init__(self):
        super().__init__()
        self.site = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in DRAWS or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        site, self.site = self.site, self.site + 1
        return draw(func, *args, site=site, **kwargs)
