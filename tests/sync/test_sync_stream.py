"""A stream's estimate of the remote's rows, which coverage is measured against."""

from __future__ import annotations

import pyarrow as pa

from epochcache.config import SourceConfig
from epochcache.sources import RemoteObject, Unit
from epochcache.sync.stream import Stream


def test_remote_rows_come_from_footers_else_from_bytes() -> None:
    stream = Stream(SourceConfig(url="/remote"), source=None)  # type: ignore[arg-type]  # not read here
    assert stream.remote_rows(0) is None, "nothing known yet"
    stream.totals[0], stream.node_bytes, stream.rows_read, stream.bytes_read = 10, 1000, 1, 2
    assert stream.remote_rows(0) == 500, "no metadata told rows (Arrow IPC, tar): rows per byte read"
    obj = RemoteObject("/remote/a.parquet", 200)
    stream.count_rows([Unit(obj, 0, 30, 0, 100), Unit(obj, 1, 10, 30, 100)])
    stream.count_rows([Unit(obj, 0, None, None, 100)])  # an object whose metadata has no row counts
    assert stream.remote_rows(0) == 400, "40 rows per object whose footer was read, 10 objects"
    assert stream.remote_rows(1) == 400, "a pass not listed yet has as many objects as the last"


def test_rows_per_byte_are_of_every_unit_read_not_the_last() -> None:
    """Tars of samples of very different sizes: the estimate of a 2,500-sample remote was a third of it
    when it took the last tar's rows per byte alone."""
    stream = Stream(SourceConfig(url="/remote"), source=None)  # type: ignore[arg-type]  # not read here
    stream.totals[0], stream.node_bytes = 3, 3000
    for name, rows in (("a", 100), ("b", 100), ("c", 10)):  # three tars of 1,000 bytes
        unit = Unit(RemoteObject(f"/remote/{name}.tar", 1000), 0, None, 0, 1000)
        stream.learn(unit, pa.table({"x": list(range(rows))}), rows)
    assert stream.remote_rows(0) == 210
