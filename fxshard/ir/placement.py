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
    """``dim`` split over the tp ranks; ``blocks`` packed blocks, each split alike (rank r holds part r of each).

    Two refinements, for packed projections whose parts differ (a Mamba-2 ``in_proj`` packs z, x, B, C and dt)
    and for heads fewer than the ranks (key/value heads under tp beyond them):

    * ``sizes``: the blocks' global sizes when they are unequal (``()``: ``blocks`` equal blocks);
    * ``parts``: per block, the number of distinct parts it is cut into when fewer than the tp ranks (0: one per
      rank).  A block of g parts is held by tp/g consecutive ranks per part (rank r holds part r * g // tp); at
      g = 1 it is whole on every rank.  Those replicas' gradients are partial, each rank's covering what its own
      computation read, and are summed over the replicas (``rt.sum_replicas`` on a parameter)::

        >>> str(Shard(1, parts=(2,))), str(Shard(0, 5, sizes=(8, 8, 4, 4, 2), parts=(0, 0, 1, 1, 0)))
        ('S(1)/2', 'S(0)[8,8,4/1,4/1,2]')
    """

    dim: int
    blocks: int = 1
    sizes: tuple[int, ...] = ()
    parts: tuple[int, ...] = ()

    def __post_init__(self):
        sizes, parts = tuple(self.sizes), tuple(self.parts)
        if sizes and len(set(sizes)) == 1:
            sizes = ()
        if parts and not any(parts):
            parts = ()
        assert not sizes or len(sizes) == self.blocks, self
        assert not parts or len(parts) == self.blocks, self
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "parts", parts)

    @property
    def general(self) -> bool:
        """Unequal blocks or parts held by several ranks: only the rules written for them take such a split as it
        is (the others see it gathered)."""
        return bool(self.sizes or self.parts)

    def block_sizes(self, size: int) -> tuple[int, ...]:
        """The global sizes of the blocks of a dimension of ``size``."""
        return self.sizes or (size // self.blocks,) * self.blocks

    def parts_of(self, block: int, tp: int) -> int:
        """How many distinct parts block ``block`` is cut into over ``tp`` ranks."""
        return (self.parts[block] if self.parts else 0) or tp

    def replicas(self, tp: int) -> tuple[int, ...]:
        """Per block, how many consecutive ranks hold each part (the runtime's and the manifest's form)."""
        return tuple(tp // self.parts_of(b, tp) for b in range(self.blocks)) if self.parts else ()

    def local_size(self, size: int, tp: int) -> int:
        """This split's size on one rank, of a dimension of ``size`` over ``tp`` ranks."""
        return sum(s // self.parts_of(i, tp) for i, s in enumerate(self.block_sizes(size)))

    def divides(self, size: int, tp: int) -> bool:
        """Whether ``tp`` ranks split a dimension of ``size`` as this placement says."""
        if self.sizes and sum(self.sizes) != size or not self.sizes and size % self.blocks:
            return False
        return all(tp % self.parts_of(i, tp) == 0 and s % self.parts_of(i, tp) == 0
                   for i, s in enumerate(self.block_sizes(size)))

    def moved(self, dim: int) -> Shard:
        """The same split along another dimension (a transpose, an unsqueeze)."""
        return Shard(dim, self.blocks, self.sizes, self.parts)

    def __str__(self) -> str:
        def cut(b):
            return f"/{self.parts[b]}" if self.parts and self.parts[b] else ""
        if self.sizes:
            return f"S({self.dim})[" + ",".join(f"{s}{cut(i)}" for i, s in enumerate(self.sizes)) + "]"
        out = f"S({self.dim})" + (f"x{self.blocks}" if self.blocks > 1 else "")
        if self.parts:
            out += cut(0) if self.blocks == 1 else "/(" + ",".join(str(g or "tp") for g in self.parts) + ")"
        return out

    def __repr__(self) -> str:
        extra = (f", blocks={self.blocks}" if self.blocks > 1 else "") + (f", sizes={self.sizes}" if self.sizes else "")
        extra += f", parts={self.parts}" if self.parts else ""
        return f"Shard({self.dim}{extra})"

    def to_json(self) -> dict:
        return {"kind": "shard", "dim": self.dim} | ({"blocks": self.blocks} if self.blocks > 1 else {}) \
            | ({"sizes": list(self.sizes)} if self.sizes else {}) | ({"parts": list(self.parts)} if self.parts else {})


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
    if kind == "shard" and set(data) <= {"kind", "dim", "blocks", "sizes", "parts"} \
            and isinstance(data.get("dim"), int) and all(isinstance(data.get(k, []), list) for k in ("sizes", "parts")):
        try:
            return Shard(data["dim"], data.get("blocks", 1), tuple(data.get("sizes", ())), tuple(data.get("parts", ())))
        except AssertionError:
            pass
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
    assert placement.divides(out[placement.dim], parts), (shape, placement, parts)
    out[placement.dim] = placement.local_size(out[placement.dim], parts)
    return tuple(out)


def slice_spec(placement: Placement, index: int, parts: int) -> SliceSpec:
    """The slice rank ``index`` of ``parts`` holds of a tensor placed by ``placement`` (the whole one unless
    sharded)."""
    if not isinstance(placement, Shard) or parts == 1:
        return SliceSpec()
    if placement.blocks == 1 and placement.parts:  # part index * g // parts of g, held by parts // g ranks alike
        g = placement.parts_of(0, parts)
        return SliceSpec(placement.dim, index * g // parts, g) if g > 1 else SliceSpec()
    return SliceSpec(placement.dim, index, parts, placement.blocks, placement.sizes, placement.replicas(parts))
