"""sampler.row_fraction: seeded row slices of units, each row cached once over ceil(1/f) passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import cached_ids, write_parquet_dataset
from pydantic import ValidationError

from epochcache import Ledger, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.publisher import EPOCH_FILL
from epochcache.config import Config, SamplerConfig
from epochcache.sources import RemoteObject, Unit
from epochcache.sources.parquet import ParquetSource
from epochcache.sync.daemon import StopReason
from epochcache.sync.sampler import Cursor, Sampler
from epochcache.sync.slicing import (
    MAX_AUTO_PARTS,
    PassShape,
    Slicer,
    cached_per_listed,
    parts_of,
    pass_shape,
)


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


def test_each_pass_caches_one_slice_and_the_passes_together_every_row_once(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    root = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), root, 4, 256, 64)
    config = make_config(root, **{"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB",
                                  "sampler.row_fraction": 0.5})
    first = SyncDaemon(config, progress=False).run(once=True)
    after_one = cached_ids(config.cache.dir)
    assert 0.35 * 1024 < len(after_one) < 0.65 * 1024 and first.samples_published == len(after_one)
    SyncDaemon(config, progress=False).run(once=True)  # the next pass: the other slice
    ids = cached_ids(config.cache.dir)
    assert sorted(ids) == list(range(1024)), "every row once over two passes"


def _sampler(**values: object) -> SamplerConfig:
    return SamplerConfig.model_validate(values)


def test_auto_shapes_the_pass_so_that_a_full_cache_spans_the_remote() -> None:
    # 200 objects of 1 MB (as cached) for a 25 MB budget: 9 slices, so that one pass's slices (22.2 MB)
    # fit in what an epoch of a full cache holds (EPOCH_FILL, 90% of 25 MB = 22.5 MB), and a window of
    # as many objects as a cache of slices holds: 9 * 25 > 200.
    auto = _sampler(row_fraction="auto", mix_units="auto")
    assert pass_shape(auto, 25_000_000, 200_000_000, 200) == PassShape(parts=9, mix=200)
    assert 200_000_000 / 9 <= EPOCH_FILL * 25_000_000 < 200_000_000 / 8
    assert pass_shape(auto, 400_000_000, 200_000_000, 200) == PassShape(parts=1, mix=200), "it all fits"
    assert pass_shape(auto, 1_000, 10**12, 5000).parts == MAX_AUTO_PARTS
    assert pass_shape(auto, 25_000_000, None, 200) == PassShape(parts=1, mix=8), "a listing without its size"
    fixed = _sampler(row_fraction=0.5, mix_units=3)
    assert pass_shape(fixed, 25_000_000, 200_000_000, 200) == PassShape(parts=2, mix=3)
    with pytest.raises(ValidationError):
        _sampler(row_fraction="half")


def test_auto_slices_a_remote_larger_than_the_budget(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    root = tmp_path / "remote"
    root.mkdir()
    rng = np.random.default_rng(0)
    for number in range(4):  # 8 MB of incompressible rows: stored size = cached size
        ids = np.arange(number * 32, (number + 1) * 32)
        payload = pa.array([rng.bytes(64 * 1024) for _ in ids], pa.binary())
        pq.write_table(pa.table({"id": ids, "payload": payload}), root / f"part-{number}.parquet", row_group_size=16)
    config = make_config(str(root), **{"cache.max_bytes": "7MB", "cache.shard_bytes": "256KB",
                                       "sampler.row_fraction": "auto", "sampler.mix_units": "auto"})
    report = SyncDaemon(config, progress=False).run(once=True)
    ids = cached_ids(config.cache.dir)
    assert len(ids) == len(set(ids)) and 0.35 * 128 < len(ids) < 0.65 * 128, "1/2 of each unit's rows"
    # Half of each 16-row group (none is empty but with odds of 2**-16), where whole groups fill it at 6.
    assert len({i // 16 for i in ids}) == 8, "a slice of every row group"
    assert report.reason is StopReason.EXHAUSTED, "the pass's slices fit in the budget"


def test_with_slices_every_pass_walks_the_same_order(tmp_path: Path) -> None:
    """Consecutive passes' slices line up: the units a cache of one pass's length misses at the end of
    one pass are the first of the next, so it holds a slice of every unit; fresh orders (whole units)
    would leave it the union of two random subsets."""
    root = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), root, 6, 64, 8)
    source = ParquetSource(root)
    objects = source.list_objects()

    def order(same_order: bool, pass_: int) -> list[str]:
        sampler = Sampler(lambda objs: [source.units(obj) for obj in objs], objects, seed=3, mix=2,
                          same_order=same_order)
        return [unit.key for unit, _ in sampler.walk(Cursor(pass_=pass_))]

    assert order(True, 0) == order(True, 1) == order(True, 7) == order(False, 0)
    assert order(False, 1) != order(False, 0) and sorted(order(False, 1)) == sorted(order(False, 0))


def _compressible_remote(root: Path) -> None:
    """4 files of 2 row groups of 64 rows: ids and 16 KiB of zeros each, zstd-compressed to almost nothing."""
    root.mkdir()
    for number in range(4):
        ids = np.arange(number * 128, (number + 1) * 128)
        payload = pa.array([bytes(16 * 1024)] * len(ids), pa.binary())
        pq.write_table(pa.table({"id": ids, "payload": payload}), root / f"part-{number}.parquet",
                       row_group_size=64, compression="zstd")


def test_the_cached_size_per_listed_byte_is_measured_on_a_unit(tmp_path: Path) -> None:
    _compressible_remote(tmp_path / "remote")
    source = ParquetSource(str(tmp_path / "remote"))
    obj = source.list_objects()[0]
    unit = source.units(obj)[0]
    ratio, read = cached_per_listed(source, obj)
    assert ratio is not None and ratio > 20, "zeros compress: the cache holds far more than the listing says"
    # the unit's share of the object: half of it (two equal row groups), so the ratio is its rows as read over that
    assert read == source.read(unit).nbytes and ratio == pytest.approx(read / (obj.size / 2), rel=0.01)


def test_auto_slices_by_the_size_as_cached_not_as_stored(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """8 MB of rows stored in a few KB: sized by the listing, a 4 MB budget would cache whole units and
    fill with half of them; sized as cached, it takes slices of every unit."""
    _compressible_remote(tmp_path / "remote")
    config = make_config(str(tmp_path / "remote"), **{
        "cache.max_bytes": "4MB", "cache.shard_bytes": "256KB", "sampler.row_fraction": "auto",
        "sampler.mix_units": "auto"})
    SyncDaemon(config, progress=False).run(once=True)
    ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
    try:
        ratio = (ledger.daemon.listing("") or {}).get("cached_per_listed")
        units = {unit for record in ledger.shards() for unit in record.units}
    finally:
        ledger.close()
    assert ratio is not None and ratio > 20, "measured once and kept with the listing, for every pass and restart"
    assert {unit.rsplit("#", 1)[0] for unit in units} == {str(tmp_path / "remote" / f"part-{n}.parquet")
                                                        for n in range(4)}
    assert len({unit.rsplit("~", 1)[0] for unit in units}) == 8, "a slice of every row group"
    assert all("~" in unit for unit in units) and len(cached_ids(config.cache.dir)) < 0.5 * 512
