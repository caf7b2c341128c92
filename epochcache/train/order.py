"""The sample order of one epoch, and each rank's part of it.

In: the number of samples in the epoch's snapshot and the loader's settings; out: one int64 numpy
array of dataset indices (never a Python list: forked workers would copy-on-write it piecewise).
The order is a pure function of (seed, epoch, n, settings), which is what lets a resumed run skip
exactly the batches it has already seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from epochcache.seeding import permutation

# A last seed word keeps the with-replacement draws and the windowed orders apart from the plain permutation.
_REPLACEMENT_STREAM = 1
_WINDOW_STREAM = 2


def epoch_order(
    n: int, seed: int, epoch: int, shuffle: bool, length: int | None = None, replacement: bool = False,
    shard_rows: Sequence[int] | None = None, window: int | None = None,
) -> np.ndarray:
    """``length`` (default ``n``) indices into ``range(n)`` for ``epoch``.

    With ``replacement`` the indices are independent uniform draws. Without it, every sample appears
    once per round of ``n`` (a fresh permutation each round, seeded by ``(seed, epoch, round)``);
    ``shuffle=False`` keeps storage order and repeats it. ``shard_rows`` (the rows of each shard, in
    dataset order) and ``window``: an epoch over more shards than ``window`` is shuffled window by
    window (:func:`windowed_permutation`), so a reader keeping ``window`` shards mapped maps each
    shard about once per round instead of at nearly every touch.
    """
    length = n if length is None else length
    if n == 0:
        return np.empty(0, np.int64)
    if replacement:
        return np.random.default_rng([seed, epoch, _REPLACEMENT_STREAM]).integers(0, n, length, dtype=np.int64)
    if not shuffle:
        return np.resize(np.arange(n, dtype=np.int64), length)
    def one_round(*words: int) -> np.ndarray:
        if shard_rows is not None and window is not None and len(shard_rows) > window:
            return windowed_permutation(shard_rows, window, np.random.default_rng([*words, _WINDOW_STREAM]))
        return permutation(n, *words)

    rounds = [one_round(seed, epoch)] + [one_round(seed, epoch, r) for r in range(1, math.ceil(length / n))]
    return np.concatenate(rounds)[:length]


def windowed_permutation(shard_rows: Sequence[int], window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of the rows of shards of ``shard_rows`` rows each (in dataset order): the shards in
    random order, cut into windows of ``window`` shards, the rows of each window shuffled together.

    Every row appears once. A batch draws from ``window`` shards (at 64 MB shards, 512 of them are
    32 GB of samples), so batches stay mixed while the shards a reader touches stay few.
    """
    rows = np.asarray(shard_rows, dtype=np.int64)
    offsets = np.cumsum(rows) - rows
    shards = rng.permutation(len(rows))
    lengths = rows[shards]
    ends = np.cumsum(lengths)
    # Row j of the run of the k-th shard taken is offsets[shards[k]] + (j - start of that run).
    order = np.arange(ends[-1], dtype=np.int64) - np.repeat(ends - lengths - offsets[shards], lengths)
    for first in range(0, len(shards), window):
        lo = int(ends[first - 1]) if first else 0
        hi = int(ends[min(first + window, len(shards)) - 1])
        rng.shuffle(order[lo:hi])  # in place: a slice is a view
    return order


def rank_part(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank`` of ``world`` readers of one order: every ``world``-th index, disjoint across ranks."""
    return order[rank::world]


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


# Batches per run (EpochBatches.runs): the first run is one batch, so the epoch's first batch waits
# for no more planning than its own; each run doubles up to this many.
_MOST_PER_RUN = 64


class EpochBatches:
    """Batch sampler: ``count`` index arrays of up to ``batch_size`` from ``order``, from batch ``start`` on.

    ``count`` may be below what ``order`` holds (ranks agree on the smallest count); ``start`` > 0 is
    a resumed epoch, which skips its first batches without reading them.
    """

    def __init__(self, order: np.ndarray, batch_size: int, count: int, start: int = 0):
        self._order, self._batch_size, self._count, self._start = order, batch_size, count, start

    @property
    def count(self) -> int:
        """Batches in the whole epoch, those skipped by a resume included."""
        return self._count

    @property
    def start(self) -> int:
        return self._start

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def __len__(self) -> int:
        return max(self._count - self._start, 0)

    def __iter__(self) -> Iterator[np.ndarray]:
        for number in range(self._start, self._count):
            yield self._order[number * self._batch_size : (number + 1) * self._batch_size]

    def runs(self) -> Iterator[np.ndarray]:
        """The same indices as iterating, in runs of whole batches (1, 2, 4, ... up to 64 batches; a run
        splits into batches every ``batch_size`` indices): a reader plans a run in one vectorised pass."""
        number, per_run = self._start, 1
        while number < self._count:
            end = min(number + per_run, self._count)
            yield self._order[number * self._batch_size : end * self._batch_size]
            number, per_run = end, min(2 * per_run, _MOST_PER_RUN)
