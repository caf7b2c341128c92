"""Footers over TLS: an https endpoint (as S3 is) guards every reply with its records' MACs, so a
Parquet or Arrow IPC footer is read once; over plain HTTP it is read twice, the second read confirming
the first (RemoteFiles.confirm). The https endpoint is the fault proxy in front of the test server,
serving a certificate made for 127.0.0.1 (as the benchmarks' https server does)."""

from __future__ import annotations

import io
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_table
from faultproxy import FaultProxy

from epochcache.sources import ArrowSource, ParquetSource
from epochcache.sources.retry import single_attempt_options

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # (appended: it shadows no module)
from s3server import self_signed_certificate  # noqa: E402  (the benchmarks' https server serves the same)

ROWS, PER_UNIT = 96, 32


@pytest.fixture(params=[True, False], ids=["https", "http"])
def endpoint(request: pytest.FixtureRequest, s3_endpoint: str, tmp_path: Path) -> Iterator[tuple[FaultProxy, Any]]:
    """The proxy (over TLS or not) in front of the test server, and the ``verify`` s3fs needs for it."""
    tls, verify = None, None
    if request.param:
        cert, key = self_signed_certificate(tmp_path)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        verify = str(cert)
    proxy = FaultProxy(s3_endpoint, rate=0.0, tls=tls)
    yield proxy, verify
    proxy.close()


def _arrow(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=PER_UNIT):
            writer.write_batch(batch)
    return sink.getvalue()


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=PER_UNIT)
    return sink.getvalue()


@pytest.mark.parametrize("kind", [ParquetSource, ArrowSource], ids=["parquet", "arrow"])
def test_a_footer_is_read_once_over_tls_and_twice_over_plain_http(
    s3: Any, bucket: str, endpoint: tuple[FaultProxy, Any], kind: type[ParquetSource | ArrowSource],
) -> None:
    proxy, verify = endpoint
    table = make_table(ROWS)
    name = "part.parquet" if kind is ParquetSource else "part.arrow"
    s3.pipe(f"{bucket}/tls/{name}", _parquet(table) if kind is ParquetSource else _arrow(table))
    url = f"s3://{bucket}/tls"
    client = {"endpoint_url": proxy.url, **({"verify": verify} if verify else {})}
    options = single_attempt_options(url, {"key": "testing", "secret": "testing", "client_kwargs": client}, 10.0)
    source = kind(url, storage_options=options, whole_object_bytes=0)  # (ranged: a whole read checks its footer)
    (obj,) = source.list_objects()
    units = source.units(obj)
    read = pa.concat_tables([source.read(unit) for unit in units])
    assert len(units) == ROWS // PER_UNIT
    assert read.column("id").to_pylist() == list(range(ROWS))
    assert read.column("image").equals(table.column("image"))
    footer_gets = 1 if proxy.url.startswith("https://") else 2
    assert proxy.object_gets == footer_gets + len(units), "the tail (confirmed by a second read over HTTP), the units"
