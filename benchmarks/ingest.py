"""Ingest benchmark: the sync daemon's MB/s against the raw ceiling of the same server.

A moto S3 server runs on loopback in a child process (so it does not share our GIL). We upload
``--size-mb`` of Parquet (incompressible binary samples, row groups of ``--row-group-mb``), then, in
the same run against the same server, measure:

- ceiling: plain concurrent ranged GETs (s3fs ``cat_file``) of exactly the row groups' bytes, with
  ``--concurrency`` threads, nothing decoded or written;
- ceiling with footer GETs: the same, plus the GETs of each file's last 64 KiB that the daemon makes
  (its footer, then, over plain HTTP, the footer again to confirm it; over TLS only the first): the
  ceiling of the daemon's own requests;
- ingest: ``SyncDaemon.run(once=True)`` with ``sampler.concurrency = --concurrency`` into a fresh
  cache with room for everything: list, footers, GETs, decode, shard write (fsync) and publish.

MB/s counts the same remote bytes (the row groups' spans) in both, 10**6 bytes per MB. Ceiling and
ingest are measured in interleaved rounds and the medians reported, as other load on the machine varies.
Each also gets the CPU seconds it cost this process (client) and the server (from ``/proc``): on a
machine whose cores are all busy, MB/s follows the CPU both sides spend per byte, and on moto every
GET costs the server a read of the whole object, whatever its range (a footer's as much as a row group's).

Then, once per remote format (the same samples as Parquet and as Arrow IPC, one record batch per row
group), ``epochcache sync --once`` runs as a process of its own with 64 MB shards: its peak PSS
(:mod:`epochcache.tools.pss`, sampled every 20 ms) and its CPU time per sample cached (user + system,
from the kernel's accounting of the finished process, start-up and imports included).

With ``--server-cpu N`` the server runs on CPU ``N`` alone and this process (the ceiling's GETs, the
daemon, its process) on the others, as with a remote store, whose CPUs are not the client's; without it
(the default) both share every core, and on a machine whose cores are all busy the ratio measures the
CPU the daemon spends per byte as much as its I/O.

With ``--tls`` the server speaks https (a certificate made for 127.0.0.1), as S3 does by default: every
request, the ceiling's too, pays for TLS, and the daemon reads each footer once (TLS guards it in transit).

Prints a table and writes JSON to ``benchmarks/results/ingest.json``. Usage: ``python
benchmarks/ingest.py [--size-mb 500] [--row-group-mb 8] [--file-mb 64] [--concurrency 8] [--rounds 3]
[--server-cpu N] [--tls]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import s3fs
from s3server import moto_server, self_signed_certificate

from epochcache import SyncDaemon, SyncReport, load_config
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.tools.pss import tree_pss_bytes

SAMPLE_BYTES = 16 * 1024
FOOTER_GET_BYTES = 64 * 1024  # the tail a Parquet source reads for a file's footer
RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=500.0, help="remote data size (default 500)")
    parser.add_argument("--row-group-mb", type=float, default=8.0, help="row group size (default 8)")
    parser.add_argument("--file-mb", type=float, default=64.0, help="Parquet file size (default 64)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    parser.add_argument("--cache-parent", default=None,
                        help="folder to create the cache dirs in (default: the system temp folder)")
    parser.add_argument("--server-cpu", type=int, default=None,
                        help="run the server on this CPU alone and the client on the others (default: shared)")
    parser.add_argument("--tls", action="store_true", help="serve https, as S3 does (default: plain HTTP)")
    args = parser.parse_args()
    server_cpus = set() if args.server_cpu is None else {args.server_cpu}
    if server_cpus:
        others = os.sched_getaffinity(0) - server_cpus
        if not others or not server_cpus <= os.sched_getaffinity(0):
            parser.error(f"--server-cpu {args.server_cpu}: give one of the CPUs {sorted(os.sched_getaffinity(0))}, "
                         "leaving at least one for the client")
        os.sched_setaffinity(0, others)  # before any thread: the ones started later, and children, inherit it
    with tempfile.TemporaryDirectory() as certs:
        tls = self_signed_certificate(Path(certs)) if args.tls else None
        with moto_server(server_cpus, tls) as endpoint:
            result = run(endpoint, args, None if tls is None else str(tls[0]))
    print_table(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ingest.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'ingest.json'}")


def run(endpoint: str, args: argparse.Namespace, verify: str | None) -> dict[str, object]:
    """The measurements against the server at ``endpoint`` (``verify``: the certificate to trust over https)."""
    client = {"endpoint_url": endpoint, **({"verify": verify} if verify else {})}
    options = {"key": "bench", "secret": "bench", "client_kwargs": client}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    fs.mkdir("bench")
    spans = upload(fs, "bench/data", args)
    remote_bytes = sum(end - start for _, start, end in spans)
    arrow_from_parquet(fs, "bench/data", "bench/arrow")
    # The daemon's own requests include more GETs per Parquet file, of its footer: the tail, then over
    # plain HTTP the footer again to confirm it (epochcache.sources.remote.RemoteFiles.confirm). On moto
    # each GET costs the server a read of the whole object, so they weigh here as row groups do.
    footer_gets = 1 if verify else 2
    footers = [(path, max(0, size - FOOTER_GET_BYTES), size) for path in sorted({p for p, _, _ in spans})
               for size in [fs.info(path)["size"]] for _ in range(footer_gets)]
    ceilings, footed, ingests, report = [], [], [], None
    ceiling_cpu: list[tuple[float, float]] = []
    ingest_cpu: list[tuple[float, float]] = []
    server = _server_pid()
    for _ in range(args.rounds):  # interleaved, so load from elsewhere on the machine hits both alike
        before = _cpu(server)
        ceilings.append(raw_gets(fs, spans, args.concurrency))
        middle = _cpu(server)
        seconds, report = ingest_once(options, remote_bytes, args.concurrency, args.cache_parent)
        ingests.append(seconds)
        after = _cpu(server)
        ceiling_cpu.append((middle[0] - before[0], middle[1] - before[1]))
        ingest_cpu.append((after[0] - middle[0], after[1] - middle[1]))
        footed.append(raw_gets(fs, spans + footers, args.concurrency))
    ceiling_s, ingest_s = statistics.median(ceilings), statistics.median(ingests)
    ceiling, ingest = remote_bytes / ceiling_s / 1e6, remote_bytes / ingest_s / 1e6
    return {
        "size_mb": round(remote_bytes / 1e6, 1), "row_groups": len(spans), "concurrency": args.concurrency,
        "rounds": args.rounds, "ingest_mb_s": round(ingest, 1), "ceiling_mb_s": round(ceiling, 1),
        "ratio": round(ingest / ceiling, 3), "ingest_s": round(ingest_s, 2), "ceiling_s": round(ceiling_s, 2),
        "tls": verify is not None, "footer_gets_per_file": footer_gets,
        "ceiling_with_footers_s": round(statistics.median(footed), 2),
        "ratio_with_footers": round(statistics.median(footed) / ingest_s, 3),
        "ingest_s_rounds": [round(s, 2) for s in ingests], "ceiling_s_rounds": [round(s, 2) for s in ceilings],
        "ceiling_cpu_s": _median_cpu(ceiling_cpu), "ingest_cpu_s": _median_cpu(ingest_cpu),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cache_parent": args.cache_parent or tempfile.gettempdir(),
        "cpus": ("shared" if args.server_cpu is None else
                 f"server on CPU {args.server_cpu}, client on {sorted(os.sched_getaffinity(0))}"),
        "units_published": report.units_published, "samples_published": report.samples_published,
        "daemon_process": {kind: daemon_process(options, kind, url, remote_bytes, args.concurrency, args.cache_parent)
                           for kind, url in (("parquet", "s3://bench/data"), ("arrow", "s3://bench/arrow"))},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }


def _server_pid() -> int:
    """The moto server: this process's only child while nothing else runs."""
    children = [int(pid) for task in Path("/proc/self/task").iterdir()
                for pid in (task / "children").read_text().split()]
    if len(children) != 1:
        raise RuntimeError(f"expected the moto server as the only child process, found {children}")
    return children[0]


def _cpu(server: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by this process and by ``server``."""
    own = os.times()
    fields = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return own.user + own.system, (int(fields[11]) + int(fields[12])) / ticks


def _median_cpu(rounds: list[tuple[float, float]]) -> dict[str, float]:
    return {"client": round(statistics.median(c for c, _ in rounds), 2),
            "server": round(statistics.median(s for _, s in rounds), 2)}


def ingest_once(
    options: dict[str, object], remote_bytes: int, concurrency: int, cache_parent: str | None
) -> tuple[float, SyncReport]:
    """Seconds for ``SyncDaemon.run(once=True)`` to cache the whole remote into a fresh cache dir."""
    with tempfile.TemporaryDirectory(dir=cache_parent) as cache:
        config = load_config(None, {
            "source.url": "s3://bench/data", "source.storage_options": options,
            "cache.dir": cache, "cache.max_bytes": int(remote_bytes * 1.5) + 64 * 10**6,
            "cache.shard_bytes": "64MB", "sampler.concurrency": concurrency,
        })
        start = time.perf_counter()
        report = SyncDaemon(config, progress=False).run(once=True)
        seconds = time.perf_counter() - start
    if report.units_published == 0:
        raise RuntimeError("the daemon published nothing: the benchmark measured no ingest")
    return seconds, report


def daemon_process(
    options: dict[str, object], kind: str, url: str, remote_bytes: int, concurrency: int, cache_parent: str | None
) -> dict[str, float]:
    """``epochcache sync --once`` of ``url`` as a process: its peak PSS (MB), CPU s and CPU µs per sample."""
    with tempfile.TemporaryDirectory(dir=cache_parent) as cache:
        config = Path(cache) / "config.json"  # JSON is YAML: the storage options keep their nesting
        config.write_text(json.dumps({
            "source": {"url": url, "format": kind, "storage_options": options},
            "cache": {"dir": str(Path(cache) / "c"), "max_bytes": int(remote_bytes * 1.5) + 64 * 10**6,
                      "shard_bytes": "64MB"},
            "sampler": {"concurrency": concurrency},
        }))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        daemon = subprocess.Popen([sys.executable, "-m", "epochcache", "sync", "-c", str(config), "--once",
                                   "--no-progress"])
        peak = 0
        while daemon.poll() is None:
            peak = max(peak, tree_pss_bytes(daemon.pid))
            time.sleep(0.02)  # a sampling period, not a synchronisation
        seconds = time.perf_counter() - start
        # The exit status and CPU times of the finished child, from the kernel (children's rusage).
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        if daemon.returncode != 0:
            raise RuntimeError(f"epochcache sync --once of {url} exited {daemon.returncode}")
        ledger = Ledger(CacheLayout.create(Path(cache) / "c").ledger)
        samples = ledger.usage().rows
        ledger.close()
    return {"peak_pss_mb": round(peak / 2**20, 1), "cpu_s": round(cpu, 2),
            "cpu_us_per_sample": round(cpu / samples * 1e6, 1),
            "samples": samples, "seconds": round(seconds, 2)}


def arrow_from_parquet(fs: s3fs.S3FileSystem, source: str, target: str) -> None:
    """Each Parquet file of ``source`` rewritten as an Arrow IPC file under ``target``, one record
    batch per row group (the same samples, so both formats are measured on equal data)."""
    for path in sorted(fs.ls(source)):
        with fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            name = path.rsplit("/", 1)[1].replace(".parquet", ".arrow")
            with fs.open(f"{target}/{name}", "wb") as out, pa.ipc.new_file(out, parquet.schema_arrow) as writer:
                for index in range(parquet.num_row_groups):
                    writer.write_table(parquet.read_row_group(index))


def upload(fs: s3fs.S3FileSystem, root: str, args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """Write the Parquet files; return every row group's (path, start, end) byte span."""
    rows_per_group = max(1, int(args.row_group_mb * 1e6) // SAMPLE_BYTES)
    groups_per_file = max(1, round(args.file_mb / args.row_group_mb))
    groups = max(1, round(args.size_mb / args.row_group_mb))
    rng = np.random.default_rng(0)
    spans: list[tuple[str, int, int]] = []
    for number, first in enumerate(range(0, groups, groups_per_file)):
        count = min(groups_per_file, groups - first)
        rows = count * rows_per_group
        payload = rng.integers(0, 256, size=rows * SAMPLE_BYTES, dtype=np.uint8).tobytes()
        column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(SAMPLE_BYTES), rows, [None, pa.py_buffer(payload)])
        table = pa.table({"id": pa.array(np.arange(rows, dtype=np.int64)), "sample": column})
        path = f"{root}/part-{number:04d}.parquet"
        with fs.open(path, "wb") as f:
            pq.write_table(table, f, row_group_size=rows_per_group, compression="none", use_dictionary=False)
        spans.extend(row_group_spans(fs, path))
    return spans


def row_group_spans(fs: s3fs.S3FileSystem, path: str) -> list[tuple[str, int, int]]:
    with fs.open(path, "rb") as f:
        metadata = pq.read_metadata(f)
    spans = []
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        starts = [min(c.data_page_offset, c.dictionary_page_offset or c.data_page_offset)
                  for c in (group.column(i) for i in range(group.num_columns))]
        ends = [s + group.column(i).total_compressed_size for i, s in enumerate(starts)]
        spans.append((path, min(starts), max(ends)))
    return spans


def raw_gets(fs: s3fs.S3FileSystem, spans: list[tuple[str, int, int]], concurrency: int) -> float:
    """Seconds to GET every span once with ``concurrency`` threads (each length is checked)."""
    def get(span: tuple[str, int, int]) -> int:
        path, start, end = span
        data = fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise RuntimeError(f"{path} {start}-{end}: got {len(data)} bytes")
        return len(data)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        sum(pool.map(get, spans))
    return time.perf_counter() - start


def print_table(result: dict[str, object]) -> None:
    rows = [("remote data (MB)", f"{result['size_mb']:.0f} in {result['row_groups']} row groups"),
            ("concurrency; rounds (medians)", f"{result['concurrency']}; {result['rounds']}"),
            ("ceiling: raw concurrent GETs (MB/s)", f"{result['ceiling_mb_s']} ({result['ceiling_s']} s)"),
            ("ingest: SyncDaemon --once (MB/s)", f"{result['ingest_mb_s']} ({result['ingest_s']} s)"),
            ("ingest / ceiling", f"{result['ratio']:.1%}"),
            (f"ceiling with the daemon's {result['footer_gets_per_file']} footer GETs per file (s)",
             f"{result['ceiling_with_footers_s']}"),
            ("ingest / ceiling with footer GETs", f"{result['ratio_with_footers']:.1%}"),
            *((f"{name}: CPU s, client + server (medians)", f"{cpu['client']} + {cpu['server']}")
              for name, cpu in (("ceiling", result["ceiling_cpu_s"]), ("ingest", result["ingest_cpu_s"]))),
            ("load average at the end (1, 5, 15 min)", ", ".join(map(str, result["load_average"]))),
            *((f"sync --once process, {kind}: peak PSS MB; CPU s; µs/sample",
               f"{d['peak_pss_mb']}; {d['cpu_s']}; {d['cpu_us_per_sample']} ({d['samples']} samples, {d['seconds']} s)")
              for kind, d in result["daemon_process"].items()),
            ("cache dirs under", result["cache_parent"]),
            ("CPUs", result["cpus"]),
            ("protocol", "https" if result["tls"] else "http"),
            ("machine", result["machine"])]
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}} | value")
    print(f"{'-' * width}-|------")
    for name, value in rows:
        print(f"{name:<{width}} | {value}")


if __name__ == "__main__":
    main()
