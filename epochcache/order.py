"""The sample order of one epoch, and each rank's part of it.

In: the number of samples in the epoch's snapshot and the loader's settings; out: one int64 numpy
array of dataset indices (never a Python list: forked workers would copy-on-write it piecewise).
The order is a pure function of (seed, epoch, n, settings), which is what lets a resumed run skip
exactly the batches it has already seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from epochcache.seeding import permutation

# A third seed word keeps the with-replacement draws apart from the epoch's permutation.
_REPLACEMENT_STREAM = 1


def epoch_order(
    n: int, seed: int, epoch: int, shuffle: bool, length: int | None = None, replacement: bool = False
) -> np.ndarray:
    """``length`` (default ``n``) indices into ``range(n)`` for ``epoch``.

    With ``replacement`` the indices are independent uniform draws. Without it, every sample appears
    once per round of ``n`` (a fresh permutation each round, seeded by ``(seed, epoch, round)``);
    ``shuffle=False`` keeps storage order and repeats it.
    """
    length = n if length is None else length
    if n == 0:
        return np.empty(0, np.int64)
    if replacement:
        return np.random.default_rng([seed, epoch, _REPLACEMENT_STREAM]).integers(0, n, length, dtype=np.int64)
    if not shuffle:
        return np.resize(np.arange(n, dtype=np.int64), length)
    rounds = [permutation(n, seed, epoch)] + [permutation(n, seed, epoch, r) for r in range(1, math.ceil(length / n))]
    return np.concatenate(rounds)[:length]


def rank_part(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank`` of ``world`` readers of one order: every ``world``-th index, disjoint across ranks."""
    return order[rank::world]


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


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

    def __len__(self) -> int:
        return max(self._count - self._start, 0)

    def __iter__(self) -> Iterator[np.ndarray]:
        for number in range(self._start, self._count):
            yield self._order[number * self._batch_size : (number + 1) * self._batch_size]
