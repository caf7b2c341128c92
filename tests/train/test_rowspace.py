"""RowSpace and RowPlan: rows gathered from several shards' columns, fresh or into given arrays."""

from __future__ import annotations

import numpy as np
import pytest

from epochcache.train.rowspace import RowSpace


@pytest.mark.parametrize(("dtype", "item_shape"), [(np.uint8, (3, 4, 5)), (np.int64, ()), (np.float32, (7,))])
def test_planned_rows_and_rows_written_into_an_array_are_the_rows_asked_for(
    dtype: type, item_shape: tuple[int, ...]
) -> None:
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
    assert np.array_equal(plan.rows(10, 30), expected[10:30])
    into = np.zeros_like(expected)
    space.rows_into(space.positions(shard_of, local), into)
    assert np.array_equal(into, expected)
