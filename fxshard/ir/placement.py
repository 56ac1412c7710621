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

# the slice a rank holds is runtime data (rank files and checkpoints read it): one arithmetic, there
from fxshard.runtime.slices import SliceSpec, assemble, take

__all__ = ["Shard", "Replicate", "Partial", "Placement", "R", "local_shape", "slice_spec", "SliceSpec", "take",
           "assemble"]


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


def slice_spec(placement: Placement, index: int, parts: int) -> SliceSpec:
    """The slice rank ``index`` of ``parts`` holds of a tensor placed by ``placement`` (the whole one unless sharded)."""
    if isinstance(placement, Shard) and parts > 1:
        return SliceSpec(placement.dim, index, parts, placement.blocks)
    return SliceSpec()
