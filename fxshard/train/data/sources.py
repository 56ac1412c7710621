"""Where a split's examples come from, one rule for every rank and for the single-device reference.

First match wins:

1. ``--data PATH`` (``--eval-data`` for validation): a token file, read in sequences of the compiled length
   (:mod:`fxshard.train.data.tokens`); the model file's ``make_dataset`` is then not used (said at launch).
2. ``make_dataset(split)`` in the model file: a map-style ``Dataset`` or an ``IterableDataset`` of single examples,
   each one row of ``make_inputs()``; ``collate(examples)`` builds a batch if the model file defines it.
3. ``make_batches()`` (training only): a short list of whole global batches, cycled.  Every rank builds the list
   and keeps its rows: for small cases and tests.
4. The example batch ``make_inputs()``, every step (and the validation split of a model file with no dataset).
"""

from __future__ import annotations

import torch

from fxshard.errors import DataError
from fxshard.train.data.options import DataOptions
from fxshard.train.data.spec import BatchSpec, Source

SPLITS = ("train", "validation")


def resolve_source(mf, spec: BatchSpec, split: str, options: DataOptions = DataOptions(), seed: int = 0,
                   manifest=None) -> Source:
    """The source of ``split`` for model file ``mf`` (a :class:`~fxshard.capture.modelfile.ModelFile`)."""
    if split not in SPLITS:
        raise DataError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    if options.data is not None:
        from fxshard.train.data.windows import token_source

        return token_source(mf, spec, split, options, manifest)
    make_dataset = getattr(mf.module, "make_dataset", None)
    if callable(make_dataset):
        return _dataset_source(mf, spec, split, make_dataset, seed)
    if split == "train" and callable(getattr(mf.module, "make_batches", None)):
        return _batch_list(mf, seed)
    return Source("batches", f"{mf.path.name}: make_inputs()", batches=[mf.build_inputs(seed)])


def _dataset_source(mf, spec: BatchSpec, split: str, make_dataset, seed: int) -> Source:
    from torch.utils.data import IterableDataset

    where = f"{mf.path}: make_dataset({split!r})"
    if spec.apart:
        c = spec.apart[0]
        how = f"an entry per True position of {c.counted_by!r}" if c.counted_by is not None else "no batch dimension"
        raise DataError(f"{where}: input {c.key!r} of make_inputs() does not lead with the batch ({how}), and a "
                        "dataset's examples are rows of the batch; give such batches whole with make_batches(), or "
                        "give the input a leading batch dimension")
    if spec.nested:
        raise DataError(f"{where}: make_inputs() holds nested containers ({sorted(map(str, spec.constants))}); a "
                        "dataset's examples are rows of tensor inputs: make the batch a flat dict or tuple")
    torch.manual_seed(seed + 3)  # a generated dataset is the same on every rank
    try:
        dataset = make_dataset(split)
    except Exception as e:  # the user's code: named, not a traceback through fxshard
        raise DataError(f"{where} raised {type(e).__name__}: {e}; fix the model file (call make_dataset({split!r}) "
                        "on its own to see the traceback)") from e
    collate = getattr(mf.module, "collate", None)
    if isinstance(dataset, IterableDataset):
        return Source("stream", where, dataset=dataset, collate=collate, model_file=mf.path)
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise DataError(f"{where} returned {type(dataset).__name__}; expected a map-style "
                        "torch.utils.data.Dataset (__getitem__ and __len__) or an IterableDataset of examples")
    return Source("dataset", where, dataset=dataset, collate=collate, model_file=mf.path)


def _batch_list(mf, seed: int) -> Source:
    from fxshard.capture.modelfile import check_inputs

    where = f"{mf.path}: make_batches()"
    torch.manual_seed(seed + 2)
    batches = list(mf.module.make_batches())
    if not batches:
        raise DataError(f"{where} returned no batch; return a list of batches, or define make_dataset(split)")
    for i, b in enumerate(batches):
        check_inputs(b, f"{where}[{i}]")
    return Source("batches", where, batches=batches)
