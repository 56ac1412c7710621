"""Placements: how one tensor is laid out over one mesh axis.

``Shard(dim)`` splits a dimension in equal contiguous parts, one per rank; ``Shard(dim, blocks=3)``
splits each of 3 equal blocks of that dimension (a packed q/k/v projection), so rank r holds
``[q_r, k_r, v_r]``.  ``Replicate()`` is a full copy on every rank, ``Partial("sum")`` a value
whose true value is the sum over ranks.  ``repr`` evaluates back; ``str`` is short for comments::

    >>> str(Shard(1, blocks=3)), repr(Replicate()), str(Partial())
    ('S(1)x3', 'Replicate()', 'P(sum)')
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" + (f"x{self.blocks}" if self.blocks > 1 else "")

    def __repr__(self) -> str:
        return f"Shard({self.dim})" if self.blocks == 1 else f"Shard({self.dim}, blocks={self.blocks})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"

    def __str__(self) -> str:
        return f"P({self.reduce})"

    def __repr__(self) -> str:
        return f"Partial({self.reduce!r})"


Placement = Shard | Replicate | Partial
R = Replicate()


def local_shape(shape: tuple[int, ...], placement: Placement, parts: int) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape`` under ``placement`` over ``parts`` ranks."""
    if not isinstance(placement, Shard):
        return tuple(shape)
    out = list(shape)
    assert out[placement.dim] % parts == 0, (shape, placement, parts)
    out[placement.dim] //= parts
    return tuple(out)


@dataclass(frozen=True)
class SliceSpec:
    """Which part of a source tensor one rank holds: the manifest's record of a local tensor.

    ``index`` of ``parts`` along ``dim``, inside each of ``blocks`` equal blocks.
    ``parts == 1`` means the whole tensor.
    """

    dim: int = 0
    index: int = 0
    parts: int = 1
    blocks: int = 1

    @classmethod
    def of(cls, placement: Placement, index: int, parts: int) -> SliceSpec:
        if isinstance(placement, Shard) and parts > 1:
            return cls(placement.dim, index, parts, placement.blocks)
        return cls()

    def ranges(self, size: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` along ``dim`` of a source dimension of ``size``."""
        block = size // self.blocks
        step = block // self.parts
        return [(b * block + self.index * step, b * block + (self.index + 1) * step) for b in range(self.blocks)]

    def to_json(self) -> dict:
        return {"dim": self.dim, "index": self.index, "parts": self.parts, "blocks": self.blocks}


def take(full, sl: SliceSpec):
    """The part of ``full`` that ``sl`` describes (a copy-free view where possible)."""
    import torch

    if sl.parts == 1:
        return full
    pieces = [full.narrow(sl.dim, a, b - a) for a, b in sl.ranges(full.shape[sl.dim])]
    return torch.cat(pieces, dim=sl.dim) if len(pieces) > 1 else pieces[0]


def assemble(pieces, shape):
    """Rebuild a full tensor of ``shape`` from ``[(SliceSpec, local), ...]`` covering it."""
    import torch

    first = pieces[0][1]
    full = torch.empty(shape, dtype=first.dtype)
    for sl, local in pieces:
        if sl.parts == 1:
            full.copy_(local)
            continue
        ranges = sl.ranges(shape[sl.dim])
        step = ranges[0][1] - ranges[0][0]
        for k, (a, b) in enumerate(ranges):
            full.narrow(sl.dim, a, b - a).copy_(local.narrow(sl.dim, k * step, step))
    return full
