"""What a batch of the compiled program looks like, row by row: the contract between a data source and the step.

The example batch (``make_inputs()``) fixes it: a dict of keyword arguments or a tuple of positional ones, whose
tensors share a first dimension, the global batch of one step (``rows``).  A dataset example is one row of it:
the same keys (or positions) holding tensors of the row's shape and dtype.  The batch's other values (``use_cache:
False``) are constants, taken from the example batch::

    spec = BatchSpec.of(model_file.build_inputs(seed))
    spec.rows                       # 4: examples per global batch
    spec.check_example(ex, "model.py: make_dataset('train')[0]")
    batch = spec.stack([ex0, ex1])  # a batch of 2 rows, constants filled in
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fxshard.errors import DataError


@dataclass(frozen=True)
class Column:
    """One tensor input: its key in the batch (a keyword or a position), and one row's shape and dtype."""

    key: str | int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    # an input that does not lead with the batch (fxshard.capture.rows): the mask whose True positions its entries
    # follow (row_shape: one entry's), or whole (row_shape: all of it)
    counted_by: str | int | None = None
    whole: bool = False

    def describe(self) -> str:
        return f"{list(self.row_shape)} {str(self.dtype).removeprefix('torch.')}"

    def shape_in(self, batch: dict, rows: int) -> tuple[int, ...]:
        """Its shape in ``batch``, a batch of ``rows`` rows."""
        if self.whole:
            return self.row_shape
        if self.counted_by is not None:
            return (int(batch[self.counted_by].sum()), *self.row_shape)
        return (rows, *self.row_shape)


@dataclass(frozen=True)
class BatchSpec:
    positional: bool
    rows: int  # examples in one global batch
    columns: tuple[Column, ...]  # the tensor inputs, in the batch's order
    constants: dict  # key -> the example batch's value, for the inputs that are not tensors
    nested: bool = False  # the example batch holds containers: only whole batches (make_batches) can feed it

    @classmethod
    def of(cls, example: Any, where: str = "make_inputs()", counted: dict | None = None) -> BatchSpec:
        """The spec of the example batch ``example`` (the model file's ``make_inputs()``); ``counted``: its inputs
        counted by a mask as the compile found them (:class:`fxshard.capture.rows.Rows`), else as the example
        shows them."""
        from fxshard.capture.rows import Rows

        positional = not isinstance(example, dict)
        items = list(enumerate(example)) if positional else list(example.items())
        apart = Rows.of(example, counted)
        columns, constants, nested, rows = [], {}, False, set()
        for key, v in items:
            if isinstance(v, torch.Tensor):
                if v.dim() == 0:
                    raise DataError(f"{where}: input {key!r} is a 0-d tensor; every tensor of a batch has the batch "
                                    "as its first dimension")
                if key in apart.whole:
                    columns.append(Column(key, tuple(v.shape), v.dtype, whole=True))
                    continue
                columns.append(Column(key, tuple(v.shape[1:]), v.dtype, apart.counted.get(key)))
                if key not in apart.counted:
                    rows.add(v.shape[0])
            elif isinstance(v, (dict, list, tuple)):
                nested = True
                constants[key] = v
            else:
                constants[key] = v
        if len(rows) > 1:
            raise DataError(f"{where}: the tensors' first dimensions differ ({sorted(rows)}); every tensor input "
                            "holds the batch along its first dimension")
        return cls(positional, rows.pop() if rows else 1, tuple(columns), constants, nested)

    @property
    def apart(self) -> list[Column]:
        """The tensor inputs that do not lead with the batch (counted by a mask, or whole)."""
        return [c for c in self.columns if c.counted_by is not None or c.whole]

    @property
    def row_layout(self):
        """How the batch's inputs hold its rows, as :class:`fxshard.capture.rows.Rows` (what splits them)."""
        from fxshard.capture.rows import Rows

        return Rows(self.rows, {c.key: c.counted_by for c in self.columns if c.counted_by is not None},
                    tuple(c.key for c in self.columns if c.whole))

    @property
    def keys(self) -> list[str | int]:
        return [c.key for c in self.columns]

    def column(self, key) -> Column:
        return next(c for c in self.columns if c.key == key)

    def check_example(self, example: Any, where: str) -> None:
        """Refuse an example that is not one row of the compiled batch, naming what differs and the fix."""
        kind = "a tuple of tensors, one per positional input" if self.positional else "a dict of tensors by input name"
        if self.positional != (not isinstance(example, dict)) or not isinstance(example, (dict, tuple, list)):
            raise DataError(f"{where}: an example is {type(example).__name__}; expected {kind} (one row of "
                            "make_inputs())")
        got = dict(enumerate(example)) if self.positional else example
        missing = [k for k in self.keys if k not in got]
        extra = [k for k in got if k not in self.keys and k not in self.constants]
        if missing or extra:
            raise DataError(f"{where}: the example's inputs {sorted(map(str, got))} differ from the compiled tensor "
                            f"inputs {list(map(str, self.keys))}"
                            + (f" (missing {missing})" if missing else "") + (f" (unknown {extra})" if extra else "")
                            + "; return one row of make_inputs() per example")
        for c in self.columns:
            v = got[c.key]
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != c.row_shape or v.dtype != c.dtype:
                found = f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor) \
                    else type(v).__name__
                raise DataError(f"{where}: input {c.key!r} of an example is {found}; the program was compiled for "
                                f"rows of {c.describe()} (make_inputs() without its batch dimension). Make the "
                                "dataset return that shape and dtype (cut or pad to the compiled length), or "
                                "recompile with make_inputs() of the dataset's shape")

    def stack(self, examples: list, unread: frozenset = frozenset()) -> Any:
        """The batch of ``examples`` (rows in order): each tensor input stacked, constants added, the inputs in
        ``unread`` None (a pipeline rank that does not read them)."""
        values = {c.key: None if c.key in unread else torch.stack([_get(e, c.key) for e in examples])
                  for c in self.columns}
        return self.assemble(values)

    def assemble(self, values: dict) -> Any:
        """A batch in the example batch's structure from ``values`` by key, constants added."""
        values = {**self.constants, **values}
        if self.positional:
            return tuple(values[i] for i in range(len(values)))
        return dict(values)

    def check_batch(self, batch: Any, rows: int, where: str, unread: frozenset = frozenset()) -> None:
        """Refuse a collated batch that is not ``rows`` rows of the compiled inputs."""
        got = dict(enumerate(batch)) if self.positional and isinstance(batch, (tuple, list)) else batch
        if not isinstance(got, dict):
            raise DataError(f"{where}: returned {type(batch).__name__}; expected a batch like make_inputs()")
        for c in self.columns:
            if c.key in unread:
                continue
            v = got.get(c.key)
            want = c.shape_in(got, rows) if c.counted_by is None or c.counted_by not in unread else \
                (v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else -1, *c.row_shape)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != want or v.dtype != c.dtype:
                found = f"{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise DataError(f"{where}: input {c.key!r} is {found}; expected {list(want)} "
                                f"{str(c.dtype).removeprefix('torch.')} (this rank's {rows} rows of the compiled "
                                "batch)")


def _get(example, key):
    return example[key]


def local_slice(batch: Any, dp_rank: int, dp_size: int, rows=None) -> Any:
    """This dp rank's rows of a whole global batch: each tensor split along its first dimension (as the batch
    divides over dp), other values as they are; ``rows``: the batch's inputs that do not lead with it
    (:class:`fxshard.capture.rows.Rows`: a counted input split by its mask's rows)."""
    from torch.utils import _pytree as pytree

    if dp_size == 1:
        return batch
    if rows is not None and not rows.leading:
        part = rows.batch // dp_size
        return rows.take(batch, dp_rank * part, (dp_rank + 1) * part)
    return pytree.tree_map(lambda v: v.tensor_split(dp_size)[dp_rank] if isinstance(v, torch.Tensor) and v.dim()
                           else v, batch)


@dataclass
class Source:
    """One split's examples.  ``kind``: "tokens", "dataset" (map-style), "stream" (an IterableDataset),
    "batches" (whole global batches); ``name`` names it in messages and in the data state."""

    kind: str
    name: str
    dataset: Any = None  # tokens, dataset, stream: what yields single examples
    batches: list | None = None  # batches: the global batches, cycled
    collate: Any = None  # the model file's collate(examples), or None: stack
    model_file: Any = None  # the model file defining dataset and collate (a loader worker imports it first)

    def __len__(self) -> int:
        return len(self.batches) if self.kind == "batches" else len(self.dataset)

    @property
    def sized(self) -> bool:
        return self.kind != "stream"

    def describe(self) -> str:
        if self.kind == "batches":
            return f"{self.name}: {len(self.batches)} global batch{'es' * (len(self.batches) != 1)}, cycled"
        if self.kind == "stream":
            return f"{self.name} (an IterableDataset, streamed)"
        return f"{self.name}: {len(self.dataset):,} examples"
