"""Which examples a dp rank reads: one global order, cut into global batches, each cut into dp parts.

The stream of a split is its examples epoch after epoch, each epoch a seeded permutation of all of them
(``shuffle``) or their own order.  Position ``p`` of the stream is example ``order(p // N)[p % N]``.  Global batch
``n`` is positions ``[n·G, (n+1)·G)``; dp rank ``d`` of ``D`` reads ``[n·G + d·b, n·G + (d+1)·b)`` with ``b = G/D``.
So the rows of every global batch are the same examples in the same order at any layout and on one device
(``D = 1``), and a run's data position is one number, the examples consumed, whatever the layout that resumes it::

    order = EpochOrder(n=1000, seed=0, shuffle=True)
    order.indices(position=0, count=4)         # the first global batch's examples
    rank_batches(order, 0, rows=4, dp_rank=1, dp_size=2)  # -> [i2, i3], [i6, i7], ...

A batch may straddle two epochs: each example is read once per epoch, whatever the batch size.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class EpochOrder:
    """The order of the examples of each epoch: seeded and new each epoch, or the examples' own."""

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        assert n > 0
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cached: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order (int32 where it fits: 4 bytes per example, the one array the order holds)."""
        if epoch not in self._cached:
            if len(self._cached) >= 2:  # a batch straddles at most two epochs
                self._cached.pop(min(self._cached))
            dtype = np.int32 if self.n < 2**31 else np.int64
            rng = np.random.default_rng([self.seed, epoch])
            perm = np.arange(self.n, dtype=dtype)
            rng.shuffle(perm)
            self._cached[epoch] = perm
        return self._cached[epoch]

    def indices(self, position: int, count: int) -> list[int]:
        """The examples at stream positions ``[position, position + count)``."""
        if not self.shuffle:
            return [(position + i) % self.n for i in range(count)]
        out = []
        while count:
            epoch, start = divmod(position, self.n)
            take = min(count, self.n - start)
            out += self.permutation(epoch)[start:start + take].tolist()
            position, count = position + take, count - take
        return out


def rank_positions(position: int, rows: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """Where this dp rank's rows of the global batch starting at stream ``position`` begin, and how many."""
    if rows % dp_size:
        from fxshard.errors import DataError

        raise DataError(f"a global batch of {rows} rows does not divide over dp={dp_size}")
    local = rows // dp_size
    return position + dp_rank * local, local


def rank_batches(order: EpochOrder, position: int, rows: int, dp_rank: int, dp_size: int) -> Iterator[list[int]]:
    """The example indices of this dp rank's part of each global batch, from stream ``position`` on, forever."""
    while True:
        start, local = rank_positions(position, rows, dp_rank, dp_size)
        yield order.indices(start, local)
        position += rows
