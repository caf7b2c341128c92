"""The user-facing operations on a cache of real shard files, against its size (part of ledger.py).

A cache of ``n`` tiny shard files (4 rows of one int64 column each, their record in their metadata
as the publisher writes them, unsynced to keep the build cheap) with their records adopted into the
ledger, then each operation once, in this order (each leaves the cache as the next expects):
``epochcache status`` and ``status --json``, ``verify`` (every checksum), ``verify --fix`` and
``gc`` as processes (wall seconds, the process's peak RSS in MB); a daemon start in this process
(the CLI's budget check against the disk, the ledger opened, the reconcile scan); the heal after a
publisher (a spawned process publishing shards as the daemon does) was killed with SIGKILL: the
next start's reconcile, then a check that files and records agree one to one (nothing lost, nothing
counted twice); ``verify --fix`` with the ledger deleted (a rebuild from every file); a loader's
first batch (its first epoch's lease and build), with its process's PSS growth; ``clear --yes``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from epochcache import EpochCachedLoader
from epochcache.cache.layout import SHARD_SUFFIX, TMP_SUFFIX, CacheLayout
from epochcache.cache.ledger import Ledger, ShardRecord
from epochcache.cache.ledger_schema import DB_NAME
from epochcache.cache.publisher import Publisher
from epochcache.cache.repair import reconcile
from epochcache.cache.shards import ShardMeta, schema_fingerprint, with_record_meta
from epochcache.cli import _warn_if_budget_exceeds_disk
from epochcache.config import CacheConfig, Config, load_config
from epochcache.tools.pss import tree_pss_bytes

BATCH = 10_000
_TABLE = pa.table({"x": pa.array(np.arange(4, dtype=np.int64))})


def shard_bytes(meta: ShardMeta) -> bytes:
    """The bytes ``write_shard`` writes for the 4-row table carrying ``meta``."""
    sink = pa.BufferOutputStream()
    table = with_record_meta(_TABLE, meta)
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def write_cache(root: Path, n: int) -> CacheLayout:
    """A cache at ``root`` of ``n`` shard files and their records."""
    layout = CacheLayout.create(root)
    schema = schema_fingerprint(_TABLE.schema)
    ledger = Ledger(layout.ledger)
    for start in range(0, n, BATCH):
        records = []
        for i in range(start, min(n, start + BATCH)):
            meta = ShardMeta(id=f"{i:012x}-{i:08x}", created=1e9 + i, units=(f"o{i}#0",))
            data = shard_bytes(meta)
            checksum = xxhash.xxh3_128(data).hexdigest()
            path = layout.shard_path(meta.id, checksum)
            path.write_bytes(data)
            records.append(ShardRecord(id=meta.id, filename=path.name, nbytes=len(data), rows=4, created=meta.created,
                                       checksum=checksum, units=meta.units, schema=schema, verified=True))
        ledger.adopt(records)
    ledger.close()
    return layout


# `epochcache ARGS`, then its peak RSS on stderr: VmHWM, as getrusage's maxrss keeps the forking parent's
_CLI = ("import re, sys\nfrom epochcache.cli import main\ntry:\n    code = main(sys.argv[1:])\nfinally:\n"
        "    status = open('/proc/self/status').read()\n"
        "    print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', status)[1], file=sys.stderr)\nsys.exit(code)\n")


def cli(config: Path, *args: str, repeat: int = 1) -> tuple[float, float]:
    """Median wall seconds of ``repeat`` runs of ``epochcache ARGS -c CONFIG`` (each must exit 0), and
    the peak RSS (MB) of the last."""
    walls = []
    for _ in range(repeat):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _CLI, *args, "-c", str(config)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, check=False)
        walls.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise RuntimeError(f"epochcache {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return statistics.median(walls), int(done.stderr.rsplit("VmHWM ", 1)[1].split()[0]) / 1024


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds of one call (no RSS: it runs in this process)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, 0.0


def daemon_start(config: Config, layout: CacheLayout) -> None:
    """What ``epochcache sync`` does before its first fetch that grows with the cache."""
    _warn_if_budget_exceeds_disk(config)
    ledger = Ledger(layout.ledger)
    try:
        reconcile(layout, ledger)
    finally:
        ledger.close()


def _publish_forever(root: str) -> None:
    """A publisher as the daemon's (spawned child): one 4-row shard after another until killed."""
    layout = CacheLayout(Path(root))
    ledger = Ledger(layout.ledger)
    publisher = Publisher(layout, ledger, CacheConfig(dir=root, max_bytes=10**12), threading.Event())
    for i in range(10**9):
        publisher.publish(_TABLE, [f"crash{i}#0"], None)


def killed_publisher(layout: CacheLayout) -> int:
    """Start a publisher, SIGKILL it once it has published a few shards (mid-publish, as its time is
    all publishing); how many it published."""
    ledger = Ledger(layout.ledger)
    before = ledger.counters.all().get("published", 0)
    child = multiprocessing.get_context("spawn").Process(target=_publish_forever, args=(str(layout.root),))
    child.start()
    deadline = time.monotonic() + 120
    while ledger.counters.all().get("published", 0) - before < 20 and time.monotonic() < deadline:
        ledger.db.version()  # a poll of the child's progress (a condition with a deadline, no fixed sleep)
        child.join(0.01)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    published = ledger.counters.all().get("published", 0) - before
    ledger.close()
    return int(published)


def agree(layout: CacheLayout) -> None:
    """Raise unless the shard files and the records agree one to one, with the bytes counted once."""
    files = {p.name: p.stat().st_size for p in layout.shards.iterdir()}
    ledger = Ledger(layout.ledger)
    try:
        records = ledger.shards()
        usage = ledger.usage()
    finally:
        ledger.close()
    if any(name.endswith(TMP_SUFFIX) for name in files):
        raise RuntimeError("a temp file survived the heal")
    if {r.filename: r.nbytes for r in records} != files or usage.shards != len(files) \
            or usage.shard_bytes != sum(files.values()):
        raise RuntimeError(f"disk and ledger disagree after the heal: {len(files)} files, {len(records)} records, "
                           f"usage {usage.shards} shards of {usage.shard_bytes} bytes")


def first_batch(layout: CacheLayout) -> tuple[float, float]:
    """Seconds from a new loader to its first batch, and the PSS (MB) it added to this process."""
    pss = tree_pss_bytes(os.getpid())
    start = time.perf_counter()
    loader = EpochCachedLoader(layout.root, batch_size=256, num_workers=0, progress=False)
    try:
        next(iter(loader))
        wall = time.perf_counter() - start
        grown = (tree_pss_bytes(os.getpid()) - pss) / 2**20
    finally:
        loader.close()
    return wall, grown


def measure_files(n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cache"
        out: dict[str, Any] = {"shards": n}
        out["build"] = timed(lambda: write_cache(root, n))
        layout = CacheLayout(root)
        path = Path(tmp) / "config.yaml"
        path.write_text(f"cache: {{dir: {root}, max_bytes: 1GB}}\nsource: {{url: {tmp}/remote}}\n")
        for name, args in (("status", ("status",)), ("status --json", ("status", "--json")),
                           ("verify", ("verify",)), ("verify --fix", ("verify", "--fix")), ("gc", ("gc",))):
            out[name] = cli(path, *args, repeat=3)
        out["daemon start"] = timed(lambda: daemon_start(load_config(path, []), layout))
        out["published, then killed"] = killed_publisher(layout)
        out["heal after kill -9"] = timed(lambda: daemon_start(load_config(path, []), layout))
        agree(layout)
        for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm"):
            (layout.ledger / name).unlink(missing_ok=True)
        out["rebuild (verify --fix)"] = cli(path, "verify", "--fix")
        agree(layout)
        out["loader first batch"] = first_batch(layout)
        out["clear --yes"] = cli(path, "clear", "--yes")
        if any(layout.shards.glob("*" + SHARD_SUFFIX)):
            raise RuntimeError("clear left shard files")
        return out


FILE_OPS = ["build", "status", "status --json", "verify", "verify --fix", "gc", "daemon start", "heal after kill -9",
            "rebuild (verify --fix)", "loader first batch", "clear --yes"]


def print_files_table(results: list[dict[str, Any]]) -> None:
    """Seconds / MB (peak RSS of the process; for the loader, the PSS it added; 0: not measured)."""
    print(f"\n{'op (s wall / MB)':<24}" + "".join(f"{r['shards']:>18}" for r in results) + f"{'growth':>10}")
    for op in FILE_OPS:
        cells = "".join(f"{r[op][0]:>10.2f}/{r[op][1]:<7.0f}" for r in results)
        growth = results[-1][op][0] / max(results[0][op][0], 1e-9)
        print(f"{op:<24}{cells}{growth:>9.2f}x")
    print(f"{'published, then killed':<24}" + "".join(f"{r['published, then killed']:>18}" for r in results))
