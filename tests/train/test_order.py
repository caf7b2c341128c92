"""Epoch orders: seeded, fixed-length with or without replacement, disjoint rank parts."""

from __future__ import annotations

import numpy as np

from epochcache.train.order import EpochBatches, batch_count, epoch_order, rank_part


def test_default_order_is_a_seeded_permutation() -> None:
    a = epoch_order(100, seed=1, epoch=0, shuffle=True)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, epoch_order(100, 1, 0, True))
    assert not np.array_equal(a, epoch_order(100, 1, 1, True))
    assert np.array_equal(epoch_order(5, 1, 0, False), np.arange(5))


def test_fixed_length_without_replacement_uses_each_sample_once_per_round() -> None:
    short = epoch_order(100, 0, 3, True, length=40)
    assert len(short) == 40 and len(set(short.tolist())) == 40
    long = epoch_order(100, 0, 3, True, length=250)
    counts = np.bincount(long, minlength=100)
    assert len(long) == 250 and counts.min() == 2 and counts.max() == 3
    assert np.array_equal(long[:100], epoch_order(100, 0, 3, True)), "round 0 is the plain epoch order"
    assert epoch_order(3, 0, 0, False, length=7).tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_fixed_length_with_replacement_draws_independently() -> None:
    draws = epoch_order(10, 0, 0, True, length=1000, replacement=True)
    assert len(draws) == 1000 and draws.min() >= 0 and draws.max() < 10
    assert len(set(draws[:20].tolist())) < 20, "with replacement, repeats appear early"
    assert np.array_equal(draws, epoch_order(10, 0, 0, True, length=1000, replacement=True))


def test_rank_parts_are_disjoint_and_cover_the_order() -> None:
    order = epoch_order(101, 0, 0, True)
    parts = [rank_part(order, r, 3) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(101))
    assert not set(parts[0].tolist()) & set(parts[1].tolist())


def test_batches_stop_at_the_agreed_count_and_resume_skips() -> None:
    order = np.arange(50)
    assert batch_count(50, 8, drop_last=False) == 7 and batch_count(50, 8, drop_last=True) == 6
    batches = list(EpochBatches(order, 8, count=4))
    assert len(batches) == 4 and batches[-1].tolist() == list(range(24, 32))
    resumed = EpochBatches(order, 8, count=4, start=3)
    assert len(resumed) == 1 and [b.tolist() for b in resumed] == [list(range(24, 32))]


def _shard_of(order: np.ndarray, rows: list[int]) -> np.ndarray:
    return np.searchsorted(np.cumsum(rows), order, side="right")


def test_an_epoch_over_more_shards_than_the_window_is_shuffled_window_by_window() -> None:
    rows = [7, 1, 30, 12, 5, 9, 3, 16, 2, 11] * 5  # 50 shards of uneven sizes
    n, window = sum(rows), 8
    order = epoch_order(n, 3, 1, True, shard_rows=rows, window=window)
    assert sorted(order.tolist()) == list(range(n)), "every sample once"
    assert np.array_equal(order, epoch_order(n, 3, 1, True, shard_rows=rows, window=window)), "seeded"
    assert not np.array_equal(order, epoch_order(n, 3, 2, True, shard_rows=rows, window=window))
    shards = _shard_of(order, rows)
    # Windows follow each other: once a shard's rows begin, at most `window` shards are open at a time.
    first, last = {}, {}
    for position, shard in enumerate(shards.tolist()):
        first.setdefault(shard, position)
        last[shard] = position
    open_at = [sum(first[s] <= p <= last[s] for s in first) for p in range(0, n, 17)]
    assert max(open_at) <= window
    assert len(set(shards[: sum(sorted(rows)[:window])].tolist())) > 1, "rows of a window are mixed"


def test_an_epoch_within_the_window_is_the_plain_permutation() -> None:
    rows = [4, 5, 6]
    assert np.array_equal(epoch_order(15, 1, 0, True, shard_rows=rows, window=3), epoch_order(15, 1, 0, True))
    long = epoch_order(15, 1, 0, True, length=40, shard_rows=[5] * 3, window=2)
    assert len(long) == 40 and np.bincount(long, minlength=15).min() == 2, "each round uses every sample"


def test_runs_hold_the_batches_in_runs_of_whole_batches_that_double() -> None:
    order = np.arange(1000)
    sampler = EpochBatches(order, 3, count=300, start=2)
    runs = list(sampler.runs())
    assert [len(r) for r in runs[:8]] == [3, 6, 12, 24, 48, 96, 192, 192], "1, 2, 4 ... 64 batches"
    assert np.array_equal(np.concatenate(runs), np.concatenate(list(sampler))), "the same indices, in order"
    short_last = EpochBatches(np.arange(10), 4, count=3)
    assert [r.tolist() for r in short_last.runs()] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
