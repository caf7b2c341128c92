"""Ledger cost per operation against cache size: records only, then a cache of real shard files.

Usage: python benchmarks/ledger.py [--sizes 1000,10000,100000] [--file-sizes 10000,50000,100000]
                                   [--out ledger.json]

For each size, a fresh ledger gets that many shard records (bulk ``adopt``, its WAL then checkpointed),
then each operation is timed (wall and CPU; the mean of 200 calls after 5 untimed for publishes, of
100 for renew, of a few for the rest): publish without eviction, publish with an eviction
(make_room over budget, fifo), snapshot + lease of the whole cache (with the checkpoint of the WAL
it writes; the first of a process, which decodes every record, and a later one of the same
process, which reuses the records it can), renew, release, status-like reads (usage + newest 20 +
lease counts), daemon start (open + the reconcile join: filenames() against a listing), then
publish+evict by the other policies (as the daemon builds them, min_uses 1; every shard used once
by then; the mean of 50 calls), an epoch's first record, a batch eviction that a lease holding
every shard turns into retiring shards, the daemon's polls for room while it waits, and last (the
ledger opened afresh) one batch evicting 90% of the cache with no lease held. Prints a
table with the growth from the smallest to the largest size, and bytes per shard.

Then, for each of ``--file-sizes``, a cache of that many tiny real shard files (see
``benchmarks/ledger_files.py``) and the user-facing operations on it: the CLI commands, a daemon
start, the heal after a publisher killed with SIGKILL, a rebuild of a lost ledger, a loader's
first batch, clear.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ledger_files import measure_files, print_files_table

from epochcache.cache.evict import Fifo, Policy, policy_named
from epochcache.cache.ledger import Ledger, ShardRecord
from epochcache.cache.ledger_schema import DB_NAME

BATCH = 10_000


def rec(i: int, nbytes: int = 64_000_000) -> ShardRecord:  # 64 MB shards: an eviction frees about one
    return ShardRecord(id=f"{i:012x}-{i % 99999999:08x}", filename=f"{i:012x}-{i % 99999999:08x}.{i:032x}.arrow",
                       nbytes=nbytes, rows=10, created=float(i), checksum=f"{i:032x}", units=(f"o{i}#0",),
                       schema="0123456789abcdef")


def timed(fn: Callable[[], object], repeat: int = 5, warmup: int = 0) -> tuple[float, float]:
    """Mean wall and CPU ms of ``repeat`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    wall = cpu = 0.0
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall += time.perf_counter() - w
        cpu += time.process_time() - c
    return wall / repeat * 1000, cpu / repeat * 1000


def measure(n: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ledger"
        ledger = Ledger(folder)
        for start in range(0, n, BATCH):
            ledger.adopt([rec(i) for i in range(start, min(n, start + BATCH))])
        per_shard = (folder / DB_NAME).stat().st_size / n
        counter = [n]

        def publish() -> None:
            counter[0] += 1
            ledger.make_room(1000, budget=10**15, choose=Fifo())
            ledger.publish(rec(counter[0]))

        def publish_evicting(policy: Policy = Fifo()) -> None:
            counter[0] += 1
            usage = ledger.usage()
            ledger.make_room(1000, budget=usage.total - usage.ledger_bytes + ledger.disk_bytes(), choose=policy)
            ledger.publish(rec(counter[0]))

        out: dict[str, object] = {"shards": n, "bytes_per_shard": round(per_shard, 1)}
        checkpoint = ledger.db.connection().execute  # a write's WAL pages are copied into the database later

        # Steady state: the bulk load's WAL is checkpointed first, and cheap operations are averaged
        # over many calls (a handful would be one checkpoint's noise).
        checkpoint("PRAGMA wal_checkpoint(TRUNCATE)")
        out["publish"] = timed(publish, repeat=200, warmup=5)
        out["publish+evict"] = timed(publish_evicting, repeat=200, warmup=5)
        leases: list[str] = []

        def snapshot(by: Ledger) -> None:
            """A snapshot and the checkpoint of the WAL it wrote: whoever writes next pays that
            checkpoint, so it is charged here."""
            leases.append(by.leases.snapshot("bench", 60).id)
            by.db.connection().execute("PRAGMA wal_checkpoint(PASSIVE)")

        def first_snapshot() -> None:
            """A process's first snapshot (a new Ledger, opened and closed with it): it decodes every record."""
            fresh = Ledger(folder)
            try:
                snapshot(fresh)
            finally:
                fresh.close()

        # Later snapshots of a process reuse the records they can (a loader takes one per epoch).
        out["snapshot"] = timed(first_snapshot, repeat=2)
        snapshot(ledger)
        out["snapshot again"] = timed(lambda: snapshot(ledger), repeat=3)
        out["renew"] = timed(lambda: ledger.leases.renew(leases[0], 60), repeat=100)
        out["release"] = timed(lambda: ledger.leases.release(leases.pop()), repeat=2)
        out["status"] = timed(lambda: (ledger.usage(), ledger.newest(20), ledger.leases.live(with_shards=False)))
        for lease_id in leases:
            ledger.leases.release(lease_id)
        for name in ("lru", "most-used", "random"):  # as the daemon picks them: min_uses 1, every shard used
            out[f"evict {name}"] = timed(lambda: publish_evicting(policy_named(name, min_uses=1)), repeat=50, warmup=3)
        out.update(backpressure(ledger))
        ledger.close()
        listing = {rec(i).filename for i in range(n)}

        def daemon_start() -> set[str]:
            """Open, then reconcile's join: the listing against the index (what disagrees)."""
            opened = Ledger(folder)
            try:
                return opened.filenames() ^ listing
            finally:
                opened.close()

        out["start"] = timed(daemon_start, repeat=2)
        out["evict 90%"] = timed(lambda: batch_eviction(folder), repeat=1)
        return out


def batch_eviction(folder: Path) -> None:
    """Open the ledger and make room down to 10% of a full budget, no lease held: one batch evicting
    nine shards in ten (a daemon restarted on a full cache with a low ``cache.low_watermark``)."""
    ledger = Ledger(folder)
    try:
        usage = ledger.usage()
        budget = usage.total - usage.ledger_bytes + ledger.disk_bytes()
        if not ledger.make_room(1000, budget=budget, choose=Fifo(), evict_to=int(budget * 0.1)):
            raise RuntimeError("a full cache with no lease evicted nothing")
    finally:
        ledger.close()


def backpressure(ledger: Ledger) -> dict[str, tuple[float, float]]:
    """An epoch's first record (every shard new to training), then a batch eviction down to 90% of
    the budget while that epoch's lease holds every shard (all picks retiring), and the daemon's
    polls for room while it waits (the mean of 20 calls, each finding nothing it may evict)."""
    lease = ledger.leases.snapshot("bench", 60).id
    out = {"first epoch record": timed(lambda: ledger.leases.record_epoch(lease, 100), repeat=1)}
    usage = ledger.usage()
    budget = usage.total - usage.ledger_bytes + ledger.disk_bytes()

    def make_room() -> None:
        if ledger.make_room(1000, budget=budget, choose=Fifo(), evict_to=int(budget * 0.9)) is not None:
            raise RuntimeError("room was made while a lease held every shard")

    out["retire 10%"] = timed(make_room, repeat=1)
    out["poll while leased"] = timed(make_room, repeat=20)
    ledger.leases.release(lease)
    return out


OPS = ["publish", "publish+evict", "snapshot", "snapshot again", "renew", "release", "status", "start", "evict lru",
       "evict most-used", "evict random", "first epoch record", "retire 10%", "poll while leased", "evict 90%"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--file-sizes", default="10000,50000,100000", help="'' for none")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = [measure(int(s)) for s in args.sizes.split(",") if s]
    files = [measure_files(int(s)) for s in args.file_sizes.split(",") if s]
    if results:
        print_table(results)
    if files:
        print_files_table(files)
    if args.out:
        args.out.write_text(json.dumps({"ledger": results, "files": files}, indent=1))


def print_table(results: list[dict[str, object]]) -> None:
    print(f"{'op (ms wall/cpu)':<18}" + "".join(f"{r['shards']:>20}" for r in results) + f"{'growth':>10}")
    for op in OPS:
        cells = "".join(f"{r[op][0]:>12.2f}/{r[op][1]:<7.2f}" for r in results)  # type: ignore[index]
        growth = results[-1][op][0] / max(results[0][op][0], 1e-9)  # type: ignore[index]
        print(f"{op:<18}{cells}{growth:>9.2f}x")
    print(f"{'bytes/shard':<18}" + "".join(f"{r['bytes_per_shard']:>20}" for r in results))


if __name__ == "__main__":
    main()
