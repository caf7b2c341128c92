"""Sampling benchmark: how random are batches from a cache of a class-sorted remote, and what it costs.

The remote (a local folder): ``--files`` Parquet files of ``--groups`` row groups of ``--group-rows``
rows, stored sorted by label, one label per row group pair (100 classes over 200 row groups by
default), each row an int32 ``label`` and a ``--payload``-byte binary ``payload``. Per setting, the
real daemon (continuous, in a thread) and an ``EpochCachedLoader`` (batch 64, the background thread)
run together on a fresh cache of ``--budget`` of the remote's cached bytes for ``--epochs`` epochs.

Per setting it prints: distinct labels per batch (and the i.i.d. expectation for batches drawn from
the whole remote), the correlation of consecutive batches' label histograms (0 for i.i.d. batches),
coverage and echo after the last epoch (``epochcache.cache.coverage``), and remote bytes read (decoded, as
the daemon counts them) per byte trained, and the bytes each epoch trained on as a share of the
budget: over the epochs after the first, and in steady state (the epochs whose snapshot came after
the cache first filled, and how many). Settings are ``--settings``, each ``name:key=value,...`` of
``--set`` overrides.

Then egress with no trainer: the daemon alone, with defaults, on a fresh cache of the same budget,
until it says "waiting for training" (``cache.min_uses``); it prints the remote bytes read (decoded,
as above) over the budget, which ``cache.min_uses`` bounds (target: at most 1.1). ``--no-egress``
leaves it out. Writes ``benchmarks/results/sampling.json``.

    python benchmarks/sampling.py [--epochs 8] [--budget 0.25] [--settings "default:;mix32:sampler.mix_units=32"]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from epochcache import EpochCachedLoader, SyncDaemon
from epochcache.cache.coverage import coverage_of
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.config import Config, load_config

RESULTS = Path(__file__).resolve().parent / "results" / "sampling.json"
BATCH = 64
DEFAULT_SETTINGS = "default:;mix32:sampler.mix_units=32;random:cache.eviction=random"
WAITING = "waiting for training"  # the daemon's state once cache.min_uses holds it back
EGRESS_TIMEOUT_S = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--groups", type=int, default=10, help="row groups per file")
    parser.add_argument("--group-rows", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--payload", type=int, default=200, help="bytes of payload per row")
    parser.add_argument("--budget", type=float, default=0.25, help="cache budget, a fraction of the remote")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--no-egress", action="store_true", help="leave out the no-trainer egress run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        remote, remote_bytes = write_remote(Path(tmp) / "remote", args)
        rows = args.files * args.groups * args.group_rows
        iid = args.classes * (1 - (1 - 1 / args.classes) ** BATCH)  # expected distinct labels of 64 i.i.d. draws
        print(f"remote: {rows} rows, {args.classes} classes stored sorted, {remote_bytes / 1e6:.1f} MB decoded; "
              f"budget {args.budget:.0%}; {args.epochs} epochs; i.i.d. batches hold {iid:.1f} distinct labels")
        print(f"{'setting':>10} {'labels/batch':>13} {'vs iid':>7} {'corr':>6} {'coverage':>9} {'echo':>6} "
              f"{'read/trained':>13} {'epoch/budget':>13} {'steady (epochs)':>16}")
        results = []
        for setting in args.settings.split(";"):
            name, _, pairs = setting.partition(":")
            overrides = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
            result = run(remote, Path(tmp) / f"cache-{name}", int(args.budget * remote_bytes), overrides, args)
            result |= {"setting": name, "overrides": overrides, "iid_labels_per_batch": iid}
            results.append(result)
            print(f"{name:>10} {result['labels_per_batch']:>13.1f} {result['labels_per_batch'] / iid:>7.2f} "
                  f"{result['correlation']:>+6.2f} {result['coverage'] or 0:>9.1%} {result['echo'] or 0:>6.2f} "
                  f"{result['read_per_trained']:>13.2f} {result['epoch_bytes_per_budget'] or 0:>13.0%} "
                  f"{result['steady_epoch_bytes_per_budget'] or 0:>11.0%} ({result['steady_epochs']:>2})")
        no_trainer = None
        if not args.no_egress:
            no_trainer = egress(remote, Path(tmp) / "cache-no-trainer", int(args.budget * remote_bytes))
            print(f"no trainer, defaults: fetched {no_trainer['fetched_per_budget']:.2f} x budget before "
                  f"\"{WAITING}\" ({no_trainer['seconds']:.1f} s)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "budget": args.budget, "epochs": args.epochs,
                                   "results": results, "no_trainer": no_trainer}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


def write_remote(root: Path, args: argparse.Namespace) -> tuple[str, int]:
    """The class-sorted remote; returns its path and its rows' decoded bytes (Arrow, before the
    cache adds each row's key column)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    groups = args.files * args.groups
    nbytes = 0
    for number in range(args.files):
        tables = []
        for group in range(number * args.groups, (number + 1) * args.groups):
            label = group * args.classes // groups
            payload = rng.integers(0, 256, (args.group_rows, args.payload), dtype=np.uint8)
            tables.append(pa.table({
                "label": pa.array(np.full(args.group_rows, label, dtype=np.int32)),
                "payload": pa.array([row.tobytes() for row in payload], pa.binary()),
            }))
        table = pa.concat_tables(tables)
        nbytes += table.nbytes
        pq.write_table(table, root / f"part-{number:03d}.parquet", row_group_size=args.group_rows)
    return str(root), nbytes


def bench_config(remote: str, cache: Path, budget: int, overrides: dict[str, str]) -> Config:
    """The benchmark's daemon settings: ``budget`` in shards of a 40th of it, then ``overrides``."""
    return load_config(None, {"source.url": remote, "cache.dir": str(cache), "cache.max_bytes": budget,
                              "cache.shard_bytes": max(64 * 1024, budget // 40), **overrides})


def start_daemon(config: Config) -> tuple[threading.Thread, threading.Event]:
    """The real daemon, continuous, in a thread of this process (as in the demo); set the event to stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=SyncDaemon(config, progress=False).run, kwargs={"stop": stop}, daemon=True)
    thread.start()
    return thread, stop


def egress(remote: str, cache: Path, budget: int) -> dict[str, Any]:
    """The daemon alone with defaults until it waits for training; remote bytes read per budget byte.
    Raises RuntimeError if it neither waits nor ends within ``EGRESS_TIMEOUT_S``."""
    thread, stop = start_daemon(bench_config(remote, cache, budget, {}))
    started = time.perf_counter()
    ledger = Ledger(CacheLayout(cache).ledger)
    try:
        while (ledger.daemon.status() or {}).get("state") != WAITING:
            if not thread.is_alive() or time.perf_counter() - started > EGRESS_TIMEOUT_S:
                raise RuntimeError(f"the daemon did not reach {WAITING!r} within {EGRESS_TIMEOUT_S} s")
            time.sleep(0.05)  # polling the daemon's state, as `epochcache status` would
        seconds = time.perf_counter() - started
    finally:
        stop.set()
        thread.join(60)
    try:
        fetched = ledger.counters.all().get("fetched_bytes", 0)
    finally:
        ledger.close()
    return {"fetched_bytes": fetched, "budget": budget, "fetched_per_budget": fetched / budget, "seconds": seconds}


def run(remote: str, cache: Path, budget: int, overrides: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Daemon and loader together for ``args.epochs`` epochs; the batch statistics and costs."""
    thread, stop = start_daemon(bench_config(remote, cache, budget, overrides))
    distinct, correlations, trained_bytes, epoch_bytes, full = [], [], 0, [], []
    started = time.perf_counter()
    try:
        with EpochCachedLoader(cache, batch_size=BATCH, columns=["label", "payload"], min_samples=budget // (
                args.payload + 8) // 2, progress=False) as loader:
            previous = None
            for _ in range(args.epochs):
                for batch in loader:
                    labels = batch["label"].numpy()
                    histogram = np.bincount(labels, minlength=args.classes).astype(float)
                    distinct.append(int(np.count_nonzero(histogram)))
                    if previous is not None and histogram.std() and previous.std():
                        correlations.append(float(np.corrcoef(previous, histogram)[0, 1]))
                    previous = histogram
                    trained_bytes += len(labels) * (args.payload + 4)
                if loader.last_epoch is not None:
                    epoch_bytes.append(loader.last_epoch.bytes)
                    full.append(made_room(cache))
    finally:
        stop.set()
        thread.join(60)
    ledger = Ledger(CacheLayout(cache).ledger)
    try:
        covered = coverage_of(ledger)
        fetched = ledger.counters.all().get("fetched_bytes", 0)
    finally:
        ledger.close()
    return {
        "labels_per_batch": float(np.mean(distinct)), "correlation": float(np.mean(correlations)),
        "coverage": None if covered is None else covered.coverage, "echo": None if covered is None else covered.echo,
        "read_per_trained": fetched / trained_bytes, "seconds": time.perf_counter() - started,
        # the bytes each epoch trained on, as a share of the budget: epochs after the first (which
        # waits for only half a budget: min_samples)
        "epoch_bytes_per_budget": float(np.mean(epoch_bytes[1:]) / budget) if len(epoch_bytes) > 1 else None,
        # steady state: epochs whose snapshot came after the cache first filled (the daemon had made room
        # by the end of the epoch before the previous one: the next snapshot is taken before an epoch ends)
        "steady_epochs": len(steady := [b for b, was_full in zip(epoch_bytes[2:], full) if was_full]),
        "steady_epoch_bytes_per_budget": float(np.mean(steady) / budget) if steady else None,
    }


def made_room(cache: Path) -> bool:
    """Whether the daemon has made room in ``cache`` yet (evicted or retired a shard): it filled once."""
    ledger = Ledger(CacheLayout(cache).ledger)
    try:
        return ledger.counters.all().get("evicted", 0) > 0 or ledger.usage().retiring_bytes > 0
    finally:
        ledger.close()


if __name__ == "__main__":
    main()
