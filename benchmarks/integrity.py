"""Integrity through a hostile remote: every cached row must be bit-identical to the source.

A moto S3 server runs on loopback in a child process, behind the tests' fault-injecting proxy
(``tests/faultproxy.py``): ``--fault-rate`` of all requests fail (503 SlowDown, reset, truncated
body, delay) and ``--flip-rate`` of successful object GETs have one bit of their body flipped. The
remote is ``--files`` Parquet files written with page checksums (``write_page_checksum=True``), each
of ``--rows`` rows in row groups of ``--group-rows``: an int64 ``id`` and a 2 KB random binary
``payload``. ``epochcache sync --once`` runs as a user runs it (a child process, its exit code kept),
then every row of every shard in the cache is compared with the row of the same id in the source.

Prints a table and writes JSON to ``benchmarks/results/integrity.json``. Usage:
``python benchmarks/integrity.py [--files 20] [--rows 400] [--group-rows 100] [--fault-rate 0.1]
[--flip-rate 0.05] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import s3fs
import yaml
from s3server import moto_server

from epochcache import Ledger
from epochcache.cache.layout import CacheLayout

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from faultproxy import FaultProxy  # noqa: E402  (the tests' proxy, on the path just above)

RESULTS = Path(__file__).resolve().parent / "results"
BUCKET = "integrity"
PAYLOAD_BYTES = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--rows", type=int, default=400, help="rows per file")
    parser.add_argument("--group-rows", type=int, default=100, help="rows per row group")
    parser.add_argument("--fault-rate", type=float, default=0.10)
    parser.add_argument("--flip-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with moto_server() as endpoint, tempfile.TemporaryDirectory() as tmp:
        source = upload(endpoint, args)
        proxy = FaultProxy(endpoint, rate=args.fault_rate, flip_rate=args.flip_rate, seed=args.seed)
        try:
            result = sync_and_compare(proxy.url, Path(tmp), source)
        finally:
            proxy.close()
        result |= {"files": args.files, "rows_in_source": len(source), "fault_rate": args.fault_rate,
                   "flip_rate": args.flip_rate, "requests": proxy.requests, "faults": dict(proxy.faults)}
    print_table(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "integrity.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'integrity.json'}")


def _fs(endpoint: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})


def upload(endpoint: str, args: argparse.Namespace) -> dict[int, bytes]:
    """Write the remote; return each row's payload by id."""
    fs = _fs(endpoint)
    fs.mkdir(BUCKET)
    rng = np.random.default_rng(args.seed)
    source: dict[int, bytes] = {}
    for number in range(args.files):
        ids = np.arange(number * args.rows, (number + 1) * args.rows, dtype=np.int64)
        payloads = [rng.bytes(PAYLOAD_BYTES) for _ in ids]
        source.update(zip(ids.tolist(), payloads))
        table = pa.table({"id": ids, "payload": pa.array(payloads, pa.binary())})
        with fs.open(f"{BUCKET}/data/part-{number:03d}.parquet", "wb") as out:
            pq.write_table(table, out, row_group_size=args.group_rows, write_page_checksum=True,
                           compression="snappy")
    return source


def sync_and_compare(endpoint: str, tmp: Path, source: dict[int, bytes]) -> dict[str, Any]:
    """``epochcache sync --once`` through ``endpoint``, then every cached row against ``source``."""
    config = tmp / "config.yaml"
    cache = tmp / "cache"
    config.write_text(yaml.safe_dump({
        "source": {"url": f"s3://{BUCKET}/data", "storage_options": {
            "key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}},
        "cache": {"dir": str(cache), "max_bytes": "1GB", "shard_bytes": "1MB"},
        "sampler": {"backoff_s": 0.05, "backoff_max_s": 1, "request_timeout_s": 5},
    }))
    done = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config), "--once", "--no-progress"],
                          capture_output=True, text=True, timeout=1800)
    layout = CacheLayout(cache)
    ledger = Ledger(layout.ledger)
    try:
        ids: list[int] = []
        identical = 0
        for record in ledger.shards():
            with pa.memory_map(str(layout.shards / record.filename)) as mapped:
                table = pa.ipc.open_file(mapped).read_all()
            for row_id, payload in zip(table.column("id").to_pylist(), table.column("payload").to_pylist()):
                ids.append(row_id)
                identical += source.get(row_id) == payload
        skipped = {key: info.get("error", "") for key, info in ledger.daemon.skipped().items()}
        counters = ledger.counters.all()
    finally:
        ledger.close()
    return {
        "exit_code": done.returncode, "rows_cached": len(ids), "rows_distinct": len(set(ids)),
        "rows_bit_identical": identical, "rows_wrong": len(ids) - identical,
        "retries": counters.get("retries", 0), "give_ups": counters.get("give_ups", 0),
        "units_skipped": skipped, "last_lines": done.stderr.strip().splitlines()[-3:],
    }


def print_table(result: dict[str, Any]) -> None:
    rows = [
        ("remote", f"{result['files']} Parquet files, {result['rows_in_source']} rows, page checksums"),
        ("faults", f"{result['fault_rate']:.0%} of requests + {result['flip_rate']:.0%} of object GETs bit-flipped"),
        ("requests", f"{result['requests']} ({', '.join(f'{k} {v}' for k, v in sorted(result['faults'].items()))})"),
        ("exit code", f"{result['exit_code']}"),
        ("rows cached", f"{result['rows_cached']} ({result['rows_distinct']} distinct)"),
        ("bit-identical", f"{result['rows_bit_identical']} (wrong: {result['rows_wrong']})"),
        ("retries", f"{result['retries']} (give-ups {result['give_ups']})"),
        ("units skipped", f"{len(result['units_skipped'])}"),
        *((f"  {key}", reason) for key, reason in sorted(result["units_skipped"].items())),
    ]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
