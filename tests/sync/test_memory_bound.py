"""The daemon's memory is bounded by design: at most ``sampler.concurrency`` units are held read
(or being read) but not yet taken into a shard, however slow the head of the fetch window is."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from conftest import write_parquet_dataset

import epochcache.sync.daemon as daemon_module
from epochcache import SyncDaemon
from epochcache.config import Config
from epochcache.sources import RemoteObject, Unit
from epochcache.sync.assembly import Building
from epochcache.sync.daemon import StopReason
from epochcache.sync.mixing import MixCursor
from epochcache.sync.sampler import Cursor

CONCURRENCY = 3
FILES, GROUPS, ROWS_PER_GROUP = 4, 6, 16


def test_units_held_never_exceed_the_concurrency_while_the_head_is_slow(
    tmp_path: Path, make_config: Callable[..., Config], monkeypatch: Any
) -> None:
    root = tmp_path / "remote"
    write_parquet_dataset(fsspec.filesystem("file"), str(root), FILES, GROUPS * ROWS_PER_GROUP, ROWS_PER_GROUP)
    config = make_config(str(root), **{"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB",
                                       "sampler.concurrency": CONCURRENCY})
    lock = threading.Lock()
    counts = {"held": 0, "most": 0, "started": 0}
    over = threading.Event()  # set once more units than the concurrency are held
    open_source = daemon_module.open_source

    def open_slow_head(*args: Any) -> Any:  # injection: the second unit read stalls (a slow GET)
        source = open_source(*args)
        read = source.read

        def counted_read(unit: Any) -> pa.Table:
            with lock:
                counts["held"] += 1
                counts["started"] += 1
                counts["most"] = max(counts["most"], counts["held"])
                if counts["held"] > CONCURRENCY:
                    over.set()
                stall = counts["started"] == 2
            if stall:  # until the window overfills (a failure), else for long enough to let it try
                over.wait(1.0)
            return read(unit)

        monkeypatch.setattr(source, "read", counted_read)
        return source

    def taken(unit: Any) -> None:  # the daemon took the unit's rows: no longer held by the window
        with lock:
            counts["held"] -= 1

    monkeypatch.setattr(daemon_module, "open_source", open_slow_head)
    report = SyncDaemon(config, progress=False, on_fetch=taken).run(once=True)

    assert report.reason is StopReason.EXHAUSTED and report.units_published == FILES * GROUPS
    assert counts["most"] == CONCURRENCY, f"held at most {counts['most']} units, the window allows {CONCURRENCY}"


def test_a_shards_rows_are_not_copied_into_the_default_pool() -> None:
    """The default pool (mimalloc) keeps what is freed: a shard's worth there stays in the daemon's PSS."""
    units = [pa.table({"x": pa.array(np.arange(start, start + 50_000, dtype=np.int64))}) for start in (0, 50_000)]
    building = Building(MixCursor({"": Cursor()}, {"": 0}))
    for number, table in enumerate(units):
        building.add(Unit(RemoteObject("o", 1), number, table.num_rows, None, table.nbytes), table)
    default = pa.default_memory_pool()
    default_before = default.bytes_allocated()

    rows = building.rows()

    assert rows.column("x").num_chunks == 1 and rows.column("x").to_numpy().tolist() == list(range(100_000))
    assert default.bytes_allocated() - default_before < rows.nbytes


def test_units_held_stay_within_max_inflight_bytes_when_the_units_are_large(
    tmp_path: Path, make_config: Callable[..., Config], monkeypatch: Any
) -> None:
    root = tmp_path / "remote"
    write_parquet_dataset(fsspec.filesystem("file"), str(root), FILES, GROUPS * ROWS_PER_GROUP, ROWS_PER_GROUP)
    unit_bytes = pq.read_metadata(root / "part-000.parquet").row_group(0).total_byte_size
    config = make_config(str(root), **{"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB",
                                       "sampler.concurrency": 8, "sampler.max_inflight_bytes": int(2.5 * unit_bytes)})
    lock = threading.Lock()
    counts = {"held": 0, "most": 0}
    open_source = daemon_module.open_source

    def open_counted(*args: Any) -> Any:
        source = open_source(*args)
        read = source.read

        def counted_read(unit: Any) -> pa.Table:
            with lock:
                counts["held"] += 1
                counts["most"] = max(counts["most"], counts["held"])
            return read(unit)

        monkeypatch.setattr(source, "read", counted_read)
        return source

    def taken(unit: Any) -> None:
        with lock:
            counts["held"] -= 1

    monkeypatch.setattr(daemon_module, "open_source", open_counted)
    report = SyncDaemon(config, progress=False, on_fetch=taken).run(once=True)

    assert report.reason is StopReason.EXHAUSTED and report.units_published == FILES * GROUPS
    assert counts["most"] == 2, f"held at most {counts['most']} units of {unit_bytes} bytes under a cap of 2.5 units"
