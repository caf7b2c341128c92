"""Shared fixtures: a real S3-protocol server on loopback (moto), s3fs clients to it, datasets."""

from __future__ import annotations

import gc
import logging
import os
import random
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
from faultproxy import FaultProxy

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.shards import open_shard
from epochcache.config import Config, load_config
from epochcache.sync.daemon import SyncDaemon

ITEM_SHAPE = (3, 16, 16)

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request lines drown real logs


_SESSION_ENDPOINTS: set[str] = set()  # the moto server's, once started (s3_endpoint)
_SESSION_STARTED = time.monotonic()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--budget-s", type=float, default=None,
                     help="leave out (skip, saying so) the tests that would start once the session has run this many "
                          "seconds: .ci/run gives the slow tests what is left of its 10 minutes")


def pytest_runtest_setup(item: pytest.Item) -> None:
    budget = item.config.getoption("--budget-s")
    if budget is not None and time.monotonic() - _SESSION_STARTED > budget:
        pytest.skip(f"left out: this session's --budget-s {budget:.0f} is spent (run it without --budget-s)")


@pytest.fixture(autouse=True, scope="session")
def _package_compiled() -> None:
    """The package's bytecode written once, for the processes the tests start (daemons, trainers, the
    CLI): where PYTHONDONTWRITEBYTECODE is set (CI), each compiled every module of it again, 0.6 s."""
    import compileall

    import epochcache

    compileall.compile_dir(Path(epochcache.__file__).parent, quiet=1)


@pytest.fixture(autouse=True, scope="session")
def _service_models_parsed_once() -> Iterator[None]:
    """Every botocore session parses S3's service model and endpoint data (JSON of megabytes) anew:
    0.1-0.3 s per S3 client, and the tests make hundreds (each fixture, source, daemon, retried
    listing): a third of the suite's time on 2 cores. Here the test process's sessions share one
    loader, which parses each file once; what the code under test does is unchanged (the files are
    botocore's read-only data, and processes the tests start parse their own)."""
    import botocore.loaders
    import botocore.session

    loaders: dict[str | None, botocore.loaders.Loader] = {}
    create = botocore.session.create_loader

    def create_loader(search_path_string: str | None = None) -> botocore.loaders.Loader:
        if search_path_string not in loaders:
            loaders[search_path_string] = create(search_path_string)
        return loaders[search_path_string]

    patch = pytest.MonkeyPatch()
    patch.setattr(botocore.session, "create_loader", create_loader)
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _no_filesystem_kept() -> Iterator[None]:
    """A test's S3 filesystems of other endpoints than the session's moto server (its fault proxies,
    on ports of their own) forgotten by fsspec's instance cache once it ends. Each kept one more
    client and its service model: 2.6 million objects after tests/sources/, which every full
    collection of this process walked (2.1 s each). The moto server's is kept: every test reuses it."""
    yield
    cache = s3fs.S3FileSystem._cache  # (clear_instance_cache() would drop the shared one too)
    for token, fs in list(cache.items()):
        if fs.client_kwargs.get("endpoint_url") not in _SESSION_ENDPOINTS:
            del cache[token]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's EPOCHCACHE_* or AWS settings; credentials are moto's dummies."""
    for key in list(os.environ):
        if key.startswith(("EPOCHCACHE_", "AWS_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server on 127.0.0.1, on a free port, for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    _SESSION_ENDPOINTS.add(f"http://{host}:{port}")
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict[str, Any]:
    """storage_options that point s3fs at the loopback server (as a user's config.yaml would)."""
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}


@pytest.fixture
def s3(s3_options: dict[str, Any]) -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options)
    return fs


@pytest.fixture
def bucket(s3: s3fs.S3FileSystem) -> Iterator[str]:
    """A fresh, empty bucket per test."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3.mkdir(name)
    yield name
    s3.rm(name, recursive=True)


@pytest.fixture
def quirky(s3_endpoint: str) -> Iterator[Callable[..., FaultProxy]]:
    """``quirky(**proxy options)``: a FaultProxy (no random faults) in front of the test server, closed after."""
    proxies: list[FaultProxy] = []

    def start(**options: Any) -> FaultProxy:
        proxies.append(FaultProxy(s3_endpoint, rate=0.0, **options))
        return proxies[-1]

    yield start
    for proxy in proxies:
        proxy.close()


def upload_multipart(s3: s3fs.S3FileSystem, path: str, parts: list[bytes]) -> str:
    """Upload ``parts`` (each but the last 5 MiB or more: S3's least) as one multipart object at
    ``path`` (``bucket/key``); its ETag (``"<md5 of the parts' MD5s>-<parts>"``)."""
    bucket, key = path.split("/", 1)
    upload = s3.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    done = [{"PartNumber": number, "ETag": s3.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload,
                                                       PartNumber=number, Body=body)["ETag"]}
            for number, body in enumerate(parts, 1)]
    reply = s3.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                       MultipartUpload={"Parts": done})
    return str(reply["ETag"])


def make_table(rows: int, start: int = 0, seed: int = 0) -> pa.Table:
    """``rows`` samples: a fixed-shape uint8 tensor whose pixels all equal ``id % 251`` and an id."""
    ids = np.arange(start, start + rows, dtype=np.int64)
    images = np.broadcast_to((ids % 251).astype(np.uint8)[:, None, None, None], (rows, *ITEM_SHAPE)).copy()
    return pa.table({"image": pa.FixedShapeTensorArray.from_numpy_ndarray(images), "id": pa.array(ids)})


def cached_ids(cache_dir: str | Path) -> list[int]:
    """The ``id`` of every row in the published shards of ``cache_dir`` (retiring ones included), in
    the ledger's order: a sample cached twice is there twice."""
    layout = CacheLayout(Path(cache_dir))
    ledger = Ledger(layout.ledger)
    try:
        return [i for r in ledger.shards() for i in open_shard(layout.shards / r.filename)["id"].to_pylist()]
    finally:
        ledger.close()


def write_parquet_dataset(
    fs: Any, root: str, files: int, rows_per_file: int, rows_per_group: int
) -> list[str]:
    """Write ``files`` Parquet files under ``root`` (any fsspec fs); ids run 0..files*rows_per_file."""
    fs.makedirs(root, exist_ok=True)
    paths = []
    for number in range(files):
        path = f"{root}/part-{number:03d}.parquet"
        with fs.open(path, "wb") as f:
            pq.write_table(make_table(rows_per_file, number * rows_per_file), f, row_group_size=rows_per_group)
        paths.append(path)
    return paths


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., Config]:
    """Build a validated Config from dotted overrides, with a fresh cache dir under tmp_path."""

    def build(url: str, **overrides: Any) -> Config:
        values = {"source.url": url, "cache.dir": str(tmp_path / "cache"), **overrides}
        return load_config(None, values)

    return build


class _Cycle:
    """Garbage only the cyclic collector frees: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


def dropped_cycle() -> weakref.ref[Any]:
    """A weak reference to cyclic garbage made now: dead once a collection that may free it ran."""
    return weakref.ref(_Cycle())


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The heap unfrozen (a loader with workers not closed earlier in this process may have frozen it)
    and collected (on Python 3.12 that leaves its immortal objects frozen, as in any process that has
    run a while), then no automatic collection during the test: garbage it makes lives until a
    ``gc.collect()`` may free it, not until a collection set off by chance (before a freeze it means
    to test, say)."""
    gc.unfreeze()
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.01) -> Any:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s: {condition}")
        time.sleep(interval)


class UnitLog:
    """Collects the unit keys a daemon fetched and published, through its hooks."""

    def __init__(self) -> None:
        self.fetched: list[str] = []
        self.published: list[str] = []

    def daemon(self, config: Config) -> Any:
        return SyncDaemon(
            config, progress=False,
            on_fetch=lambda unit: self.fetched.append(unit.key),
            on_publish=lambda record: self.published.extend(record.units),
        )


class DaemonThread:
    """Runs ``SyncDaemon.run`` in a thread; ``stop()`` sets its stop event and returns its report."""

    def __init__(self, daemon: Any, once: bool = False) -> None:
        self.stop_event = threading.Event()
        self.report: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(daemon, once), daemon=True)
        self._thread.start()

    def _run(self, daemon: Any, once: bool) -> None:
        try:
            self.report = daemon.run(once=once, stop=self.stop_event)
        except BaseException as exc:  # handed to the test thread by stop()
            self.error = exc

    def stop(self, timeout: float = 60.0) -> Any:
        self.stop_event.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail("sync daemon did not stop within the timeout")
        if self.error is not None:
            raise self.error
        return self.report


@pytest.fixture
def synced_cache(tmp_path: Path, make_config: Callable[..., Config]) -> Callable[..., Config]:
    """Build a cache holding a whole local Parquet remote (one ``sync --once`` pass, roomy budget):
    ``(files, rows_per_file, rows_per_group, shard_bytes) -> Config``."""

    def build(files: int, rows_per_file: int, rows_per_group: int, shard_bytes: str) -> Config:
        remote = str(tmp_path / "remote")
        write_parquet_dataset(fsspec.filesystem("file"), remote, files, rows_per_file, rows_per_group)
        config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": shard_bytes})
        SyncDaemon(config, progress=False).run(once=True)
        return config

    return build


class FullDisk:
    """Fault injection for the ledger's disk: :meth:`connect` (a ``Ledger``/``SyncDaemon`` ``connect``)
    makes connections whose write transactions fail as on a full disk: the next ``fail_next`` of
    them, then each with probability ``chance`` (drawn from a generator seeded by ``seed``).
    ``writes`` and ``refused`` count them."""

    def __init__(self, chance: float = 0.0, seed: int = 0) -> None:
        self.fail_next, self.chance, self._draw = 0, chance, random.Random(seed)
        self.writes = self.refused = 0

    def _refuse(self) -> bool:
        self.writes += 1
        if self.fail_next > 0:
            self.fail_next -= 1
        elif not (self.chance and self._draw.random() < self.chance):
            return False
        self.refused += 1
        return True

    def connect(self, path: Path) -> sqlite3.Connection:
        disk = self

        class Connection(sqlite3.Connection):
            def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
                if sql == "BEGIN IMMEDIATE" and disk._refuse():
                    raise sqlite3.OperationalError("database or disk is full")
                return super().execute(sql, parameters)

        con = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False, factory=Connection)
        con.execute("PRAGMA journal_mode=WAL")
        return con
