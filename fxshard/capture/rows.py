"""Which inputs of a batch lead with its rows, and the rows of a batch, an input that does not lead included.

Every tensor input of a batch holds the batch along its first dimension, but for one kind: a masked-image-modelling
head takes ``labels`` for the masked positions only, ``[N_masked]`` in row-major order of ``bool_masked_pos``
``[B, P]``, and computes ``cross_entropy(scores[bool_masked_pos], labels)``.  Such an input is *counted* by its mask:
rows ``[i, j)`` of the batch own its entries ``[mask[:i].sum(), mask[:j].sum())``.  A data-parallel rank or a
pipeline microbatch taking rows of the batch takes those entries of a counted input (:meth:`Rows.take`).  Shapes
are fixed at compile, so every part (a dp rank's rows, a microbatch) must hold as many entries as the compiled one:
each row masking the same number of positions, as BEiT's and SimMIM's mask generators do (:meth:`Rows.part_sizes`).
An input whose first dimension is neither the batch nor counted (a class-weight table given as an input) is *whole*:
taken as it is where nothing splits the batch, refused where something does::

    >>> import torch
    >>> mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    >>> batch = {"pixels": torch.randn(2, 4), "mask": mask, "labels": torch.tensor([7, 8, 9, 10])}
    >>> rows = Rows.of(batch)
    >>> rows.batch, rows.counted
    (2, {'labels': 'mask'})
    >>> rows.take(batch, 1, 2)["labels"]
    tensor([ 9, 10])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Rows:
    """How a batch's top-level tensor inputs (by key: a keyword, or a position) hold its ``batch`` rows."""

    batch: int | None
    # input -> the boolean mask input whose True positions its entries follow
    counted: dict = field(default_factory=dict)
    whole: tuple = ()  # inputs whose first dimension is neither the batch nor counted: never split

    @classmethod
    def of(cls, batch: Any, counted: dict | None = None) -> Rows:
        """The rows of ``batch`` (a dict or a tuple): the leading size most tensor inputs share (the first one's on a
        tie); ``counted``: the counted inputs as the compile found them (:func:`paired_with_masks`), else each input
        whose first dimension is another size and equals the True count of exactly one boolean mask of the rows."""
        items = _items(batch)
        sizes = [v.shape[0] for _, v in items if v.dim()]
        if not sizes:
            return cls(None)
        common = Counter(sizes).most_common()
        b = next(s for s in sizes if Counter(sizes)[s] == common[0][1])
        if counted is None:
            counted = {}
            for key, v in items:
                if v.dim() and v.shape[0] != b:
                    masks = [k for k, m in items if _is_mask(m, b) and int(m.sum()) == v.shape[0]]
                    if len(masks) == 1:
                        counted[key] = masks[0]
        whole = tuple(k for k, v in items if v.dim() and v.shape[0] != b and k not in counted)
        return cls(b, dict(counted), whole)

    @classmethod
    def of_inputs(cls, specs) -> Rows:
        """The rows of the batches a compiled program takes, from its inputs (the manifest's ``inputs``: global
        shapes, ``counted_by``, ``whole``), keyed as the batch is."""
        keys = {s.name: _top_key(s.path) for s in specs if s.is_tensor}
        batch = next((s.shape[0] for s in specs if s.is_tensor and s.shape and not s.counted_by and not s.whole),
                     None)
        return cls(batch, {keys[s.name]: keys[s.counted_by] for s in specs if s.is_tensor and s.counted_by},
                   tuple(keys[s.name] for s in specs if s.is_tensor and s.whole))

    @property
    def leading(self) -> bool:
        """Whether every tensor input leads with the batch (nothing counted, nothing whole)."""
        return not self.counted and not self.whole

    def take(self, batch: Any, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of ``batch``: each leading tensor's rows, each counted input's entries of those
        rows, each whole input as it is (nested containers' tensors by their rows)."""
        got = dict(_items(batch, tensors_only=False))
        out = {}
        for key, v in got.items():
            if key in self.counted:
                mask = got[self.counted[key]]
                first = int(mask[:start].sum())
                out[key] = v[first:first + int(mask[start:stop].sum())]
            elif key in self.whole:
                out[key] = v
            else:
                out[key] = pytree.tree_map(
                    lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() else t, v)
        return out if isinstance(batch, dict) else type(batch)(out[i] for i in range(len(out)))

    def part_sizes(self, batch: Any, parts: int) -> dict:
        """For each counted input, the entries each of ``parts`` equal runs of rows holds, in order."""
        got = dict(_items(batch, tensors_only=False))
        size = self.batch // parts
        return {key: [int(got[mask][i * size:(i + 1) * size].sum()) for i in range(parts)]
                for key, mask in self.counted.items()}


def _items(batch: Any, tensors_only: bool = True) -> list[tuple[Any, Any]]:
    items = list(batch.items()) if isinstance(batch, dict) else list(enumerate(batch))
    return [(k, v) for k, v in items if isinstance(v, torch.Tensor) or not tensors_only]


def _is_mask(v: torch.Tensor, b: int) -> bool:
    return v.dtype == torch.bool and v.dim() >= 2 and v.shape[0] == b


# ops that hand a mask on unchanged in what it selects (a view, a copy, a dtype it already has)
_PASSING = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._to_copy.default,
            torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.to.dtype,
            torch.ops.aten.contiguous.default}


def paired_with_masks(gm, inputs) -> dict[str, str]:
    """``{input: mask input}`` by placeholder name: each tensor input that one op of ``gm`` takes beside entries a
    boolean input selects (``scores[bool_masked_pos]``, or a value computed from them), with as many rows as they
    have (``cross_entropy(scores[bool_masked_pos], labels)``): the input's entries follow the mask's True positions.
    ``inputs``: the program's (:class:`~fxshard.capture.program.InputSpec`)."""
    names = {i.name for i in inputs if i.is_tensor}
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.index.Tensor:
            continue
        masks = {_source(m) for m in node.args[1] if m is not None}
        masks = [m for m in masks if m is not None and m.name in names and m.meta["val"].dtype == torch.bool]
        if len(masks) != 1:
            continue
        selected = _descendants(node)
        for n in selected:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a.name in names and a is not masks[0] and _same_rows(a, node):
                    found[a.name] = masks[0].name
    return found


def _source(node):
    """The placeholder ``node`` passes on unchanged through :data:`_PASSING` ops, or None."""
    while node.op == "call_function" and node.target in _PASSING:
        node = node.args[0]
    return node if node.op == "placeholder" else None


def _descendants(node) -> list:
    found, stack = [], [node]
    seen = set()
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            found.append(n)
            stack.extend(n.users)
    return found


def _same_rows(a, selected) -> bool:
    """Whether input ``a`` has as many rows as the masked selection ``selected`` (whose size the capture fixed)."""
    v, s = a.meta.get("val"), selected.meta.get("val")
    try:
        return bool(v.dim() and int(v.shape[0]) == int(s.shape[0]))
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return False


def first_part(inputs: Any, rows: Rows, size: int, where: str, split: str) -> Any:
    """Rows ``[0, size)`` of the example batch ``inputs`` (cloned), what the compile captures when ``split`` (the
    layout's dp ranks and microbatches, said in refusals) cuts the batch into runs of ``size`` rows.  Refused: an
    input whose first dimension is not the batch and that no mask counts, and a counted input whose parts would
    hold different numbers of entries (shapes are fixed at compile)."""
    from fxshard.errors import LayoutError

    if rows.whole:
        key = rows.whole[0]
        found = list(dict(_items(inputs))[key].shape)
        raise LayoutError(f"{where}: input {key!r} has shape {found}, whose first dimension is not the batch of "
                          f"{rows.batch}, and no boolean input [batch, ...] selects as many entries; {split} split "
                          "every input by its rows, and fxshard splits one that does not lead with the batch only "
                          "by the mask whose True positions its entries follow (labels for the masked positions "
                          "beside bool_masked_pos); give it a leading batch dimension, or train without splitting the "
                          "batch (--tp, --dp 1, --pp 1)")
    for key, sizes in rows.part_sizes(inputs, rows.batch // size).items():
        if len(set(sizes)) > 1:
            runs = f"{len(sizes)} parts of {size} row{'s' * (size != 1)}"
            raise LayoutError(f"{where}: input {key!r} holds an entry per True position of {rows.counted[key]!r}, "
                              f"and the {runs} that {split} make hold {sizes} of them; shapes are fixed at compile, "
                              "so every part must hold as many: mask the same number of positions in every row (as "
                              "BEiT's and SimMIM's mask generators do), or train without splitting the batch (--dp 1, "
                              "--pp 1)")
    part = rows.take(inputs, 0, size)
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, part)


def record_pairs(program, rows: Rows, where: str, split: str | None):
    """``program`` with each input's relation to the rows recorded (``InputSpec.counted_by``, ``.whole``), the
    counted ones as its graph pairs them with masked selections (:func:`paired_with_masks`).  Under ``split``, an
    input the example batch counts by a mask but the graph does not pair with one is refused, naming it."""
    import dataclasses

    from fxshard.errors import LayoutError

    paired = paired_with_masks(program.gm, program.inputs)
    by_key = {_top_key(i.path): i for i in program.inputs}
    if split is not None:
        for key, mask in rows.counted.items():
            spec = by_key.get(key)
            if spec is not None and spec.name not in paired:
                raise LayoutError(
                    f"{where}: input {key!r}'s first dimension is not the batch of {rows.batch} but the True count "
                    f"of {mask!r}, and the model never selects with {mask!r} (x[{mask}]) a value it meets {key!r} "
                    f"in; {split} split every input by its rows, and fxshard splits {key!r} by {mask!r} only where "
                    "the model pairs them so; give it a leading batch dimension, or train without splitting the "
                    "batch (--tp, --dp 1, --pp 1)")
    whole = {by_key[k].name for k in rows.whole if k in by_key}
    program.inputs = [dataclasses.replace(i, counted_by=paired.get(i.name, ""), whole=i.name in whole)
                      for i in program.inputs]
    return program


def _top_key(path: str):
    """The top-level key of an input's pytree path: ``"[1]['labels']"`` -> ``"labels"``; ``"[0][2]"`` -> 2."""
    import ast

    return ast.literal_eval(path.strip("[]").split("][")[1])


def check_entries(specs, leaves: list) -> None:
    """Refuse a batch whose counted inputs do not fit the compiled program: every microbatch-sized run of rows
    must hold as many True positions of the mask as the program takes entries per microbatch (``specs``: the
    manifest's inputs, ``leaves``: this rank's batch in their order; an input the rank does not read is None)."""
    from fxshard.errors import FxshardError

    by_name = {s.name: (s, v) for s, v in zip(specs, leaves, strict=True)}
    for s, v in zip(specs, leaves, strict=True):
        if not s.counted_by or v is None or by_name[s.counted_by][1] is None:
            continue
        spec, mask = by_name[s.counted_by]
        rows, want = spec.microbatch_shape[0], s.microbatch_shape[0]
        counts = [int(mask[k * rows:(k + 1) * rows].sum()) for k in range(mask.shape[0] // rows)]
        if any(c != want for c in counts) or v.shape[0] != sum(counts):
            raise FxshardError(
                f"batch input {s.name} holds an entry per True position of {s.counted_by}, and the program was "
                f"compiled for {want} per run of {rows} rows (shapes are fixed at compile); this batch's runs of "
                f"{rows} rows hold {counts} and {s.name} {v.shape[0]} entries: mask the same number of positions "
                "in every row (as BEiT's and SimMIM's mask generators do), or recompile with make_inputs() of these "
                "counts")
