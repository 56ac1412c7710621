"""Placements: how one tensor is laid out over one mesh axis.

``Shard(dim)`` splits a dimension in equal contiguous parts, one per rank; ``Shard(dim, blocks=3)``
splits each of 3 equal blocks of that dimension (a packed q/k/v projection), so rank r holds
``[q_r, k_r, v_r]``.  ``Replicate()`` is a full copy on every rank, ``Partial("sum")`` a value
whose true value is the sum over ranks.  ``repr`` evaluates back; ``str`` is short for comments; ``to_json``
is the manifest's form, which :func:`placement_from_json` reads back::

    >>> str(Shard(1, blocks=3)), repr(Replicate()), str(Partial())
    ('S(1)x3', 'Replicate()', 'P(sum)')
    >>> Shard(1, blocks=3).to_json(), placement_from_json({"kind": "replicate"})
    ({'kind': 'shard', 'dim': 1, 'blocks': 3}, Replicate())
"""

from __future__ import annotations

from dataclasses import dataclass

# the slice a rank holds is runtime data (rank files and checkpoints read it): one arithmetic, there
from fxshard.runtime.slices import SliceSpec, assemble, take

__all__ = ["Shard", "Replicate", "Partial", "Placement", "R", "local_shape", "slice_spec", "placement_from_json",
           "SliceSpec", "take", "assemble"]


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" + (f"x{self.blocks}" if self.blocks > 1 else "")

    def __repr__(self) -> str:
        return f"Shard({self.dim})" if self.blocks == 1 else f"Shard({self.dim}, blocks={self.blocks})"

    def to_json(self) -> dict:
        return {"kind": "shard", "dim": self.dim} | ({"blocks": self.blocks} if self.blocks > 1 else {})


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"

    def to_json(self) -> dict:
        return {"kind": "replicate"}


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"

    def __str__(self) -> str:
        return f"P({self.reduce})"

    def __repr__(self) -> str:
        return f"Partial({self.reduce!r})"

    def to_json(self) -> dict:
        return {"kind": "partial", "reduce": self.reduce}


Placement = Shard | Replicate | Partial
R = Replicate()


def placement_from_json(data: dict) -> Placement:
    """The placement ``to_json`` wrote; ``ValueError`` for anything else (a manifest edited or not fxshard's)."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "shard" and set(data) <= {"kind", "dim", "blocks"} and isinstance(data.get("dim"), int):
        return Shard(data["dim"], data.get("blocks", 1))
    if kind == "replicate" and set(data) == {"kind"}:
        return Replicate()
    if kind == "partial" and set(data) == {"kind", "reduce"}:
        return Partial(data["reduce"])
    raise ValueError(f"{data!r} is not a placement fxshard writes ({{'kind': 'shard', 'dim': d[, 'blocks': k]}}, "
                     "{'kind': 'replicate'} or {'kind': 'partial', 'reduce': r})")


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
