"""sampler.row_fraction: seeded row slices of units, each row cached once over ceil(1/f) passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from conftest import write_parquet_dataset

from epochcache import Ledger, SyncDaemon
from epochcache.config import Config
from epochcache.layout import CacheLayout
from epochcache.shards import open_shard
from epochcache.sources import RemoteObject, Unit
from epochcache.sync.slicing import Slicer, parts_of


@pytest.mark.parametrize(("fraction", "parts"), [(1.0, 1), (0.5, 2), (0.3, 4), (0.25, 4), (0.01, 100)])
def test_a_fraction_is_one_over_a_whole_number_of_parts(fraction: float, parts: int) -> None:
    assert parts_of(fraction) == parts


def test_the_slices_of_a_unit_partition_its_rows_the_same_way_everywhere() -> None:
    unit = Unit(RemoteObject("s3://b/x.parquet", 10), 3, 1000, 0, 10)
    table = pa.table({"id": np.arange(1000)})
    slicer = Slicer(parts=4, seed=7)
    slices = []
    for pass_ in range(4):
        (sliced,) = slicer.units([unit], pass_)
        assert sliced.key == f"s3://b/x.parquet#3~{pass_}"
        rows = Slicer(parts=4, seed=7).rows(sliced, table)["id"].to_pylist()  # another process, same draw
        assert sliced.rows == len(rows), "the slice's row count is exact"
        slices.append(rows)
    assert sorted(sum(slices, [])) == list(range(1000)), "every row in exactly one slice"
    assert all(150 < len(rows) < 350 for rows in slices)
    assert Slicer(parts=4, seed=8).rows(slicer.units([unit], 0)[0], table)["id"].to_pylist() != slices[0]
    assert Slicer().units([unit], 5) == [unit] and Slicer().rows(unit, table) is table, "1 part: whole units"


def _cached_ids(config: Config) -> list[int]:
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    try:
        return [i for r in ledger.shards() for i in open_shard(layout.shards / r.filename)["id"].to_pylist()]
    finally:
        ledger.close()


def test_each_pass_caches_one_slice_and_the_passes_together_every_row_once(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    root = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), root, 4, 256, 64)
    config = make_config(root, **{"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB",
                                  "sampler.row_fraction": 0.5})
    first = SyncDaemon(config, progress=False).run(once=True)
    after_one = _cached_ids(config)
    assert 0.35 * 1024 < len(after_one) < 0.65 * 1024 and first.samples_published == len(after_one)
    SyncDaemon(config, progress=False).run(once=True)  # the next pass: the other slice
    ids = _cached_ids(config)
    assert sorted(ids) == list(range(1024)), "every row once over two passes"
