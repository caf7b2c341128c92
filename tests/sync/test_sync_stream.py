"""A stream's estimate of the remote's rows, which coverage is measured against."""

from __future__ import annotations

from epochcache.config import SourceConfig
from epochcache.sources import RemoteObject, Unit
from epochcache.sync.stream import Stream


def test_remote_rows_come_from_footers_else_from_bytes() -> None:
    stream = Stream(SourceConfig(url="/remote"), source=None)  # type: ignore[arg-type]  # not read here
    assert stream.remote_rows(0) is None, "nothing known yet"
    stream.totals[0], stream.node_bytes, stream.rows_per_byte = 10, 1000, 0.5
    assert stream.remote_rows(0) == 500, "no metadata told rows (Arrow IPC, tar): rows per byte read"
    obj = RemoteObject("/remote/a.parquet", 200)
    stream.count_rows([Unit(obj, 0, 30, 0, 100), Unit(obj, 1, 10, 30, 100)])
    stream.count_rows([Unit(obj, 0, None, None, 100)])  # an object whose metadata has no row counts
    assert stream.remote_rows(0) == 400, "40 rows per object whose footer was read, 10 objects"
    assert stream.remote_rows(1) == 400, "a pass not listed yet has as many objects as the last"
