"""RowSpace and RowPlan: rows gathered from several shards' columns, fresh or into given arrays."""

from __future__ import annotations

import numpy as np
import pytest

from epochcache.train.rowspace import RowSpace


@pytest.mark.parametrize(("dtype", "item_shape"), [(np.uint8, (3, 4, 5)), (np.int64, ()), (np.float32, (7,))])
def test_rows_into_a_given_array_are_the_rows_gathered_fresh(dtype: type, item_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 100, (rows, *item_shape)).astype(dtype) for rows in (50, 1, 80)]
    space = RowSpace(len(shards), np.dtype(dtype), item_shape)
    for number, column in enumerate(shards):
        space.add(number, column)
    shard_of = rng.integers(0, len(shards), 40)
    local = np.array([rng.integers(0, len(shards[s])) for s in shard_of])
    expected = np.stack([shards[s][r] for s, r in zip(shard_of, local)])
    plan = space.plan(shard_of, local)
    assert np.array_equal(plan.rows(0, 40), expected)
    out = np.full_like(expected[10:30], 255)
    plan.rows_into(10, 30, out)
    assert np.array_equal(out, expected[10:30])
    into = np.zeros_like(expected)
    space.rows_into(space.positions(shard_of, local), into)
    assert np.array_equal(into, expected)


def test_no_rows_into_an_empty_array_is_a_no_op() -> None:
    space = RowSpace(1, np.dtype(np.int64), ())
    space.add(0, np.arange(5, dtype=np.int64))
    out = np.empty((0,), np.int64)
    space.plan(np.zeros(3, np.int64), np.arange(3)).rows_into(1, 1, out)
    assert out.shape == (0,)
