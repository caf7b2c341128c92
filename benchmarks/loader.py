"""Loader benchmark: warm-epoch rate per mode against a plain numpy copy, epoch gaps, time to first
batch on an empty cache, and PSS over 20 epochs. Prints a table, writes benchmarks/results/loader.json.

The data: ``--size`` bytes of 12 KB samples (a 3x64x64 uint8 image and an int64 label) in a local
Parquet "remote", synced into a cache by the real daemon. Rates are medians over warm epochs (the
first epoch of each mode warms the page cache and is left out). The steady batch interval is the
median of the intervals within warm epochs; their mean, the time per batch, is printed beside it
(a trainer faster than the loader takes batches in bursts, and then the median is short). Each
mode's share of a numpy copy is against the copy rate of the same shards measured just before and
after that mode (median of 10 passes), so the drifting load of a shared machine weighs on both sides
of the ratio alike.

    python benchmarks/loader.py [--size 250MB] [--epochs 5] [--pss-epochs 20] [--shard-bytes 12MB]
                                [--cold-shard-bytes 64MB] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ByteSize, TypeAdapter

from epochcache import EpochCachedLoader, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.shards import open_shard
from epochcache.config import Config, load_config
from epochcache.tools.pss import tree_pss_bytes
from epochcache.train.held import numpy_view

SHAPE = (3, 64, 64)
SAMPLE_BYTES = int(np.prod(SHAPE)) + 8
BATCH = 64
ROWS_PER_FILE = 2048
RESULTS = Path(__file__).with_name("results") / "loader.json"


def write_remote(root: Path, size: int) -> int:
    """Random (incompressible) samples, ``size`` bytes in all, as uncompressed Parquet files."""
    root.mkdir(parents=True)
    rows, rng = max(size // SAMPLE_BYTES, BATCH), np.random.default_rng(0)
    for number, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        n = min(ROWS_PER_FILE, rows - start)
        images = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
        table = pa.table({
            "image": pa.FixedShapeTensorArray.from_numpy_ndarray(images),
            "label": pa.array(np.arange(start, start + n, dtype=np.int64) % 10),
        })
        pq.write_table(table, root / f"part-{number:04d}.parquet", compression="none", row_group_size=256)
    return rows


def config_for(remote: Path, cache: Path, size: int, shard_bytes: str) -> Config:
    return load_config(None, {
        "source.url": str(remote), "cache.dir": str(cache),
        "cache.max_bytes": max(2 * size, 256 * 2**20), "cache.shard_bytes": shard_bytes,
    })


def shard_columns(cache: Path) -> list[np.ndarray]:
    """Every shard's two columns, as zero-copy views of the mapped files."""
    layout = CacheLayout(cache)
    ledger = Ledger(layout.ledger)
    columns = []
    for record in ledger.shards():
        table = open_shard(layout.shards / record.filename)
        columns += [numpy_view(table.column(name).chunk(0)) for name in ("image", "label")]
    ledger.close()
    return columns


def numpy_copy_times(columns: list[np.ndarray], repeats: int = 5) -> list[float]:
    """Seconds per pass of copying ``columns`` from the page cache into one preallocated buffer."""
    out = np.empty(max(c.nbytes for c in columns), np.uint8)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for column in columns:
            np.copyto(out[: column.nbytes], column.reshape(-1).view(np.uint8))
        times.append(time.perf_counter() - started)
    return times


def run_mode(cache: Path, workers: int, epochs: int, columns: list[np.ndarray]) -> dict[str, Any]:
    """Warm-epoch samples/s and MB/s, batch intervals and epoch gaps for one mode, and the numpy copy
    rate of the same bytes measured just before and just after it (the machine is shared: its load
    drifts, so each mode is compared with its own copy rate)."""
    rates: list[float] = []
    intervals: list[float] = []
    gaps: list[float] = []
    last = None
    copies = numpy_copy_times(columns)
    with EpochCachedLoader(cache, batch_size=BATCH, num_workers=workers, progress=False) as loader:
        for epoch in range(epochs + 1):
            started, samples = time.perf_counter(), 0
            for number, batch in enumerate(loader):
                now = time.perf_counter()
                samples += len(batch["label"])
                if last is not None and epoch > 0:
                    (gaps if number == 0 else intervals).append(now - last)
                last = now
            if epoch > 0:  # epoch 0 warms the page cache
                rates.append(samples / (time.perf_counter() - started))
    copies += numpy_copy_times(columns)
    rate = statistics.median(rates)
    return {
        "workers": workers, "samples_per_s": rate, "mb_per_s": rate * SAMPLE_BYTES / 1e6,
        "numpy_copy_mb_per_s": sum(c.nbytes for c in columns) / statistics.median(copies) / 1e6,
        "batch_interval_ms": statistics.median(intervals) * 1e3,
        "batch_interval_mean_ms": statistics.mean(intervals) * 1e3,
        "epoch_gap_ms": statistics.median(gaps) * 1e3, "epoch_gap_max_ms": max(gaps) * 1e3,
    }


def _run_daemon(config: Config, published: Any) -> None:
    """The daemon process: sync until SIGTERM, reporting its first publish time (a system-wide clock)."""
    first = threading.Event()

    def on_publish(_: Any) -> None:
        if not first.is_set():
            first.set()
            published.put(time.perf_counter())

    SyncDaemon(config, progress=False, on_publish=on_publish).run()


def time_to_first_batch(remote: Path, cache: Path, size: int, shard_bytes: str) -> tuple[float, float]:
    """Seconds from starting the daemon (a forked process: imports done) and the loader together on an
    empty cache to the first batch, and to the daemon's first published shard (its part of the wait)."""
    config = config_for(remote, cache, size, shard_bytes)
    CacheLayout.create(cache)  # the loader refuses a cache dir no daemon has made yet
    fork = multiprocessing.get_context("fork")
    published = fork.Queue()
    started = time.perf_counter()
    daemon = fork.Process(target=_run_daemon, args=(config, published))
    daemon.start()
    with EpochCachedLoader(cache, batch_size=BATCH, progress=False) as loader:
        next(iter(loader))
        elapsed = time.perf_counter() - started
    first_shard = published.get(timeout=60) - started
    daemon.terminate()  # SIGTERM: the daemon stops cleanly
    daemon.join(60)
    return elapsed, first_shard


def pss_per_epoch(cache: Path, epochs: int) -> list[int]:
    """Process-tree PSS, measured at the middle batch of each epoch, 2 workers."""
    pss = []
    with EpochCachedLoader(cache, batch_size=BATCH, num_workers=2, progress=False) as loader:
        for _ in range(epochs):
            middle = None
            for number, _batch in enumerate(loader):
                middle = middle or loader.last_epoch.batches // 2
                if number == middle:
                    pss.append(tree_pss_bytes())
    return pss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="250MB", help="bytes of samples (default 250MB)")
    parser.add_argument("--epochs", type=int, default=5, help="warm epochs per mode (default 5)")
    parser.add_argument("--pss-epochs", type=int, default=20)
    parser.add_argument("--shard-bytes", default="12MB",
                        help="cache.shard_bytes of the warm cache (default 12MB: about 21 shards at the default "
                             "--size, so that a batch touches many shards, as on a real cache)")
    parser.add_argument("--cold-shard-bytes", default="64MB",
                        help="cache.shard_bytes for the time to first batch on an empty cache "
                             "(default 64MB, the config default)")
    parser.add_argument("--dir", help="work dir (default: a temporary one)")
    args = parser.parse_args()
    size = int(TypeAdapter(ByteSize).validate_python(args.size))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        rows = write_remote(work / "remote", size)
        SyncDaemon(config_for(work / "remote", work / "cache", size, args.shard_bytes), progress=False).run(once=True)
        columns = shard_columns(work / "cache")
        modes = [run_mode(work / "cache", workers, args.epochs, columns) for workers in (0, 2)]
        shards = len(columns) // 2
        del columns
        first_batch_s, first_shard_s = time_to_first_batch(work / "remote", work / "cold", size, args.cold_shard_bytes)
        pss = pss_per_epoch(work / "cache", args.pss_epochs)
    report(rows, shards, modes, (first_batch_s, first_shard_s), pss, args)


def report(rows: int, shards: int, modes: list[dict[str, Any]], first: tuple[float, float],
           pss: list[int], args: argparse.Namespace) -> None:
    first_batch_s, first_shard_s = first
    growth = pss[-1] / pss[1] - 1 if len(pss) > 1 else 0.0
    rows_out = []
    for mode in modes:
        name = "0 workers (thread)" if mode["workers"] == 0 else "2 workers"
        share = mode["mb_per_s"] / mode["numpy_copy_mb_per_s"]
        rows_out += [
            (f"{name}: numpy copy of the shards, MB/s", f"{mode['numpy_copy_mb_per_s']:.0f}", "(the limit)"),
            (f"{name}: samples/s", f"{mode['samples_per_s']:.0f}", ""),
            (f"{name}: MB/s (share of numpy)", f"{mode['mb_per_s']:.0f} ({share:.0%})",
             ">= 40% (best mode)" if mode["workers"] == 0 else ">= 8%"),
            (f"{name}: steady batch interval, ms", f"{mode['batch_interval_ms']:.2f}", ""),
            (f"{name}: mean batch interval, ms", f"{mode['batch_interval_mean_ms']:.2f}", "(time per batch)"),
            (f"{name}: epoch gap median / max, ms", f"{mode['epoch_gap_ms']:.2f} / {mode['epoch_gap_max_ms']:.2f}",
             "<= 1 interval"),
        ]
    rows_out += [
        (f"time to first batch, empty cache ({args.cold_shard_bytes} shards), s", f"{first_batch_s:.3f}", "<= 0.25"),
        ("  of which: daemon's first shard published, s", f"{first_shard_s:.3f}", ""),
        (f"PSS epoch 2 -> {len(pss)}, 2 workers, MiB", f"{pss[1] / 2**20:.0f} -> {pss[-1] / 2**20:.0f}",
         f"growth {growth:+.2%} (< 2%)"),
    ]
    lines = [
        (
            f"loader benchmark: {rows} samples x {SAMPLE_BYTES} B = {rows * SAMPLE_BYTES / 1e6:.0f} MB, "
            f"batch {BATCH}, medians of {args.epochs} warm epochs, {shards} shards of {args.shard_bytes}"
        ),
        f"{'measure':<48}{'value':>18}   target",
        *(f"{label:<48}{value:>18}   {target}" for label, value, target in rows_out),
    ]
    print("\n".join(lines))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "rows": rows, "sample_bytes": SAMPLE_BYTES, "batch_size": BATCH, "size": args.size, "shards": shards,
        "shard_bytes": args.shard_bytes, "cold_shard_bytes": args.cold_shard_bytes,
        "modes": modes,
        "time_to_first_batch_s": first_batch_s, "first_shard_published_s": first_shard_s,
        "pss_bytes_per_epoch": pss, "pss_growth": growth,
    }, indent=2))


if __name__ == "__main__":
    main()
