"""This dp rank's batches of one split: a stateful iterator over a DataLoader whose workers load ahead.

A map-style source is read through a batch sampler that hands the workers this rank's example indices of each
global batch (:mod:`fxshard.train.data.order`); a stream (IterableDataset) is read by each worker, which keeps
this rank's rows of its share of the global batches; whole global batches (``make_batches``) are sliced in the
rank.  The position (examples of the split consumed by all dp ranks) advances as the caller takes batches, not as
workers prefetch, so :meth:`Batches.state_dict` is where the next batch starts.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from fxshard.errors import DataError
from fxshard.train.data.order import EpochOrder, rank_batches, rank_positions
from fxshard.train.data.spec import BatchSpec, Source, local_slice

STATE_FORMAT = 1


class Batches:
    """This dp rank's local batches of a split, forever (epoch after epoch); see :func:`open_batches`."""

    def __init__(self, source: Source, spec: BatchSpec, split: str, dp_rank: int, dp_size: int, *, seed: int = 0,
                 shuffle: bool = True, workers: int = 2, unread: frozenset = frozenset(), pin: bool | None = None,
                 ids=None):
        if spec.rows % dp_size:
            raise DataError(f"the global batch of {spec.rows} rows does not divide over dp={dp_size}")
        self.source, self.spec, self.split = source, spec, split
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.workers = seed, shuffle and source.kind in ("dataset", "tokens"), workers
        self.unread = frozenset(unread)
        self.ids = ids  # TokenIds: each example's token ids checked in the vocabulary as it is read (None: no check)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.position = 0  # examples of the split consumed, by all dp ranks together
        self._it = None
        self._loader = None

    @property
    def local_rows(self) -> int:
        return self.spec.rows // self.dp_size

    @property
    def reads_nothing(self) -> bool:
        return set(self.spec.keys) <= self.unread

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = self._start()
        batch = next(self._it)
        self.position += self.spec.rows
        return _arrived(batch) if self._loader is not None and self.workers else batch

    def state_dict(self, digest: bool = False) -> dict:
        """The data position, JSON-able: where the next batch starts, and what the examples are (``identity``, a
        token file's digest with ``digest``: :mod:`fxshard.train.data.resume`)."""
        from fxshard.train.data.resume import identity_of

        n = len(self.source) if self.source.kind in ("dataset", "tokens") else None
        state = {"format": STATE_FORMAT, "source": self.source.name, "split": self.split, "position": self.position,
                 "global_batch": self.spec.rows, "dp_size": self.dp_size,
                 "examples_per_dp_rank": self.position // self.dp_size, "seed": self.seed, "shuffle": self.shuffle,
                 "examples": n, "epoch": self.position // n if n else None,
                 "identity": {k: v for k, v in identity_of(self, digest).items() if k in ("kind", "packed", "file")}}
        if self.source.kind == "tokens":
            state["token_cursor"] = self.source.dataset.cursor(self._order(), self.position)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s position (saved under any layout: the position counts global examples).  The
        order's seed and shuffle stay this stream's own: a resume checks they are the saved ones
        (:func:`fxshard.train.data.resume.check_data_state`), or was told to continue with these."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or "position" not in state:
            raise DataError(f"a data position {state!r} this fxshard does not read (expected format "
                            f"{STATE_FORMAT} with a position)")
        from fxshard.train.data.resume import check_position

        position = check_position(state, None, "the saved data state")
        self.close()
        self.position = position

    def close(self) -> None:
        """Stop the worker processes (a later ``next`` starts them again at the position)."""
        it, self._it, self._loader = self._it, None, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter teardown: the workers are daemons and go with it
            pass

    # ------------------------------------------------------------------ the three ways of reading

    def _start(self):
        if self.reads_nothing:
            return itertools.repeat(self.spec.assemble(dict.fromkeys(self.spec.keys)))
        if self.source.kind == "batches":
            return self._sliced()
        self._loader = self._dataloader()
        return iter(self._loader)

    def _sliced(self):
        batches, rows = self.source.batches, self.spec.rows
        if self.ids is not None:
            for i, batch in enumerate(batches):
                self.ids.check(batch, f"{self.source.name} batch {i}")
        for n in itertools.count(self.position // rows):
            batch = local_slice(batches[n % len(batches)], self.dp_rank, self.dp_size, self.spec.row_layout)
            yield _without(batch, self.unread, self.spec)

    def _order(self) -> EpochOrder:
        key = (self.seed, self.shuffle)
        if getattr(self, "_order_key", None) != key:  # one permutation per epoch, made once
            self._order_key, self._cached_order = key, EpochOrder(len(self.source), self.seed, self.shuffle)
        return self._cached_order

    def _dataloader(self) -> DataLoader:
        carry = self.source.model_file if self.workers else None
        collate = _Collate(self.spec, Held(self.source.collate, carry), self.unread, self.local_rows,
                           self.source.name)
        common = dict(num_workers=self.workers, pin_memory=self.pin, worker_init_fn=_one_thread,
                      prefetch_factor=2 if self.workers else None, persistent_workers=False)
        if self.source.kind == "stream":
            stream = _RankStream(Held(self.source.dataset, carry), self.spec, self.position, self.dp_rank,
                                 self.dp_size, collate, self.source.name, self.ids)
            return DataLoader(stream, batch_size=None, **common)
        rows = _Rows(Held(self.source.dataset, carry), self.spec, self.source.name,
                     checked=self.source.kind != "tokens", ids=self.ids)
        sampler = _RankSampler(self._order(), self.position, self.spec.rows, self.dp_rank, self.dp_size)
        return DataLoader(rows, batch_sampler=sampler, collate_fn=collate, **common)


class Held:
    """An object of the model file (its dataset, its collate) on its way to a loader worker.

    Under fork a worker inherits it.  Under spawn or forkserver (macOS; Linux from Python 3.14) the worker
    unpickles it in a fresh interpreter where the model file's module (imported by path, as ``fxshard_model_<hash>``)
    is unknown, so it travels as bytes and the worker imports the model file before reading them."""

    def __init__(self, obj, model_file=None):
        self.obj, self.model_file = obj, model_file

    def __reduce__(self):
        if self.model_file is None:
            return (Held, (self.obj,))
        return (_held_in_worker, (str(self.model_file), pickle.dumps(self.obj)))


def _held_in_worker(model_file: str, payload: bytes) -> Held:
    from fxshard.capture.modelfile import load_model_file

    load_model_file(model_file)  # registers its module under the name the rank gave it
    return Held(pickle.loads(payload), model_file)


def _one_thread(_worker: int) -> None:
    torch.set_num_threads(1)  # a loader worker decodes examples; the rank's threads do the step


class _RankSampler(Sampler):
    """This dp rank's example indices of each global batch, from a stream position on, forever."""

    def __init__(self, order: EpochOrder, position: int, rows: int, dp_rank: int, dp_size: int):
        self.order, self.position, self.rows, self.dp_rank, self.dp_size = order, position, rows, dp_rank, dp_size

    def __iter__(self):
        return rank_batches(self.order, self.position, self.rows, self.dp_rank, self.dp_size)


class _Rows(torch.utils.data.Dataset):
    """A map-style dataset whose examples are checked against the compiled row as they are read."""

    def __init__(self, dataset: Held, spec: BatchSpec, name: str, checked: bool = True, ids=None):
        self.dataset, self.spec, self.name, self.checked, self.ids = dataset, spec, name, checked, ids

    def __len__(self) -> int:
        return len(self.dataset.obj)

    def __getitem__(self, i: int):
        example = self.dataset.obj[i]
        if self.checked:
            self.spec.check_example(example, f"{self.name}[{i}]")
            if self.ids is not None:
                self.ids.check(example, f"{self.name}[{i}]")
        return example


class _Collate:
    """Examples to this rank's batch: the model file's ``collate`` (checked) or a stack, constants added, inputs
    this rank does not read set to None."""

    def __init__(self, spec: BatchSpec, collate: Held, unread: frozenset, rows: int, name: str):
        self.spec, self.collate, self.unread, self.rows, self.name = spec, collate, unread, rows, name

    def __call__(self, examples: list) -> Any:
        if self.collate.obj is None:
            batch = self.spec.stack(examples, self.unread)
        else:
            batch = self.collate.obj(examples)
            self.spec.check_batch(batch, self.rows, f"{self.name.split(':')[0]}: collate()", self.unread)
            batch = _without(batch, self.unread, self.spec)
        return _to_send(batch) if get_worker_info() is not None else batch


SHARED_MEMORY_BYTES = 4 << 20  # a tensor from a loader worker at least this big comes through shared memory


class _Sent:
    """A small tensor on its way from a loader worker, as a numpy array: pickled through the worker's pipe it costs
    a copy, where torch's shared memory costs a file, an mmap and a passed descriptor per tensor (about a
    millisecond each on a busy machine, more than a small batch's whole load)."""

    def __init__(self, array):
        self.array = array

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.array)

    def pin_memory(self, device=None) -> torch.Tensor:  # the DataLoader's pinning thread (a GPU machine)
        return self.tensor().pin_memory()


def _to_send(batch: Any) -> Any:
    from torch.utils import _pytree as pytree

    def send(v):
        small = isinstance(v, torch.Tensor) and v.numel() * v.element_size() < SHARED_MEMORY_BYTES
        return _Sent(v.numpy()) if small and v.dtype != torch.bfloat16 and not v.requires_grad else v

    return pytree.tree_map(send, batch)


def _arrived(batch: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda v: v.tensor() if isinstance(v, _Sent) else v, batch)


def _without(batch: Any, unread: frozenset, spec: BatchSpec) -> Any:
    if not unread:
        return batch
    values = dict(enumerate(batch)) if spec.positional else dict(batch)
    values.update(dict.fromkeys(unread))
    return tuple(values[i] for i in range(len(values))) if spec.positional else values


class _RankStream(IterableDataset):
    """This dp rank's batches of an IterableDataset: each loader worker ``w`` of ``W`` walks the stream and collates
    this rank's rows of global batches ``w, w + W, ...`` (the DataLoader takes one batch from each worker in turn,
    so they arrive in order); the other rows are passed over, never held."""

    def __init__(self, dataset: Held, spec: BatchSpec, position: int, dp_rank: int, dp_size: int, collate: _Collate,
                 name: str, ids=None):
        self.dataset, self.spec, self.position, self.collate, self.name = dataset, spec, position, collate, name
        self.ids = ids
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stream = endless(self.dataset.obj, self.name)
        for _ in range(self.position):
            next(stream)
        rows = self.spec.rows
        first, local = rank_positions(0, rows, self.dp_rank, self.dp_size)
        for n in itertools.count():
            mine = n % workers == worker
            kept = []
            for i in range(rows):
                example = next(stream)
                if mine and first <= i < first + local:
                    where = f"{self.name} (example {self.position + n * rows + i})"
                    self.spec.check_example(example, where)
                    if self.ids is not None:
                        self.ids.check(example, where)
                    kept.append(example)
            if mine:
                yield self.collate(kept)


def endless(dataset, name: str):
    """An IterableDataset's examples epoch after epoch (``set_epoch(e)`` called when it has one)."""
    for epoch in itertools.count():
        if epoch and hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        seen = 0
        for example in dataset:
            seen += 1
            yield example
        if not seen:
            raise DataError(f"{name} yielded no example{' in epoch ' + str(epoch) if epoch else ''}; the split is "
                            "empty: return a dataset with examples")
