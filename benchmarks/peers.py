"""Peer comparison: epochcache against LitData, WebDataset and MosaicML Streaming on the same samples,
read from a moto S3 server on loopback. Prints one table, writes ``benchmarks/results/peers.json``.

The samples: ``--count`` (20,000) random, incompressible byte strings of ``--size`` (12,288) bytes, each
stamped with its index in its first 8 bytes, plus an int64 label (the index). Each system gets them in
its own format, uploaded to the server under its own prefix: epochcache Arrow IPC files (a ``binary``
column, or a ``fixed_size_list<uint8>`` one for the "tensor" row), LitData ``litdata.optimize`` chunks,
WebDataset tar shards, Streaming MDS shards; files, chunks and shards of ``--shard-mb`` (16) each, and
epochcache's ``cache.shard_bytes`` the same. (At 64 MiB, LitData 0.2.76's second epoch hung here every
time, one worker spinning in system calls, with or without persistent workers and with a 4 GiB budget;
``--child-timeout`` kills such a run and the table says so.)

What each system does: every system delivers the same batch, ``{"image": uint8 tensor (64, size),
"label": int64 tensor (64,)}``. The peers yield each sample's raw bytes and label, and one collate
function (``collate`` in ``peer_samples.py``) builds the batch: one copy of the bytes into a new
tensor. epochcache's rows marked "bytes" yield a batch of zero-copy byte buffers that the same
packing code (``pack_images``) turns into the tensor, as the loader's ``transform``; its "tensor" row
stores the images as a fixed-size list column, which the loader gathers into the batch tensor itself
(its native path).
Peers use a torch ``DataLoader`` (LitData's and Streaming's own subclasses) with ``--workers`` (2)
persistent workers, shuffling on (WebDataset: shard shuffle plus a 1,000-sample buffer). epochcache
runs its loader with a background batch thread (``thread``) and with ``--workers`` worker processes,
and once more on its thread with ``loader.max_mapped_bytes`` set (``--max-mapped-mb``, 8: the trainer
lets its mapped shard pages go past it, see README).
Every batch is checked (shape, dtype, index stamp against label) and every epoch must deliver each
sample exactly once; a system that does not is marked ``wrong`` in the table.

Each run is one child process per system (imports and PSS separate), on a fresh, empty local cache
(no system gets a cache warmed by another or by its own earlier round):

- cold epoch: from the empty cache (clock started after the imports) to the epoch's last batch. For
  epochcache the sync daemon and the trainer start together: the daemon is ``SyncDaemon.run(once=True)``
  in a process forked from the child after its imports (its own process, as ``epochcache sync`` would be,
  without the CLI's import time), and the loader waits with ``min_samples = --count`` so that its first
  epoch holds every sample, like the peers' first epoch;
- warm epochs (``--warm-epochs``, 3): the same loader again, data from the local cache. Samples/s per
  epoch counts from the previous epoch's last batch, so the gap between epochs is inside it;
- first batch: seconds from the start of the cold epoch to its first batch. epochcache's cold epoch waits
  for the whole dataset, so its first batch is measured apart, after the warm epochs, from another empty
  cache with the daemon and a loader started together, without ``min_samples``, each process's imports
  done before the clock starts (the daemon's, timed in its process, are shown apart, and so is its
  part of the wait: when it published its first shard);
- epoch gap: median time from an epoch's last batch to the next one's first, between warm epochs;
- peak PSS: the child's whole process tree (workers, the daemon, curl pipes), and for epochcache its
  daemon apart from the trainer and its workers, sampled every ~0.2 s and at each phase mark (where
  the child waits, its loader still open) by this process with
  ``epochcache.tools.pss``; beside it, "(anon)", the peak of the same PSS less mapped files (anonymous
  and shared memory): epochcache maps its shards, so the page cache of every shard its trainer has read
  counts in its PSS, where a peer that ``read()``s its files holds the same page cache outside its own;
- budget: each system is given ``--budget-mb`` (default 1.25x the samples' bytes) where it has a knob
  (epochcache ``cache.max_bytes``, LitData ``max_cache_size``, WebDataset ``cache_size``, Streaming
  ``cache_limit``); the bytes of the files under its cache dir are summed every ~0.05 s and the peak
  over all rounds compared to it;
- client CPU per sample: user + system CPU of the child's process tree per sample delivered, per phase,
  read from ``/proc`` while the child waits at the phase boundary.

Rounds (``--rounds``, 3) run every system once each, the order rotated each round so that load drifts
hit all alike; the table shows medians, then epochcache's best row against the best peer's per measure. Peers
that are not installed are skipped with a line saying so.

Install the peers in their own venv (never in the project's), torch's CPU build first, then epochcache,
then the peers pinned to what epochcache resolved: unpinned, torchvision (through LitData) brings a
CUDA torch and pip backtracks over botocore for minutes. From the repository root::

    python3 -m venv ~/peers-venv && ~/peers-venv/bin/pip install torch==2.13.0
    ~/peers-venv/bin/pip install -e '.[test]'
    ~/peers-venv/bin/pip freeze | grep -iE '^(torch|numpy|pyarrow|botocore|boto3|aiobotocore|s3fs|moto)==' \
        > ~/peers-pins.txt
    ~/peers-venv/bin/pip install -c ~/peers-pins.txt litdata webdataset mosaicml-streaming
    ~/peers-venv/bin/python benchmarks/peers.py [--count 20000] [--size 12288] [--rounds 3] [--warm-epochs 3]
        [--workers 2] [--shard-mb 16] [--budget-mb N] [--systems epochcache,litdata,...] [--child-timeout 600]

numpy 2.x leaves mosaicml-streaming at 0.10.0 (later releases want numpy < 2.2). Its ``__init__``
imports torchvision, for its image datasets only; where the torchvision pip chose does not load (on
this project's machines, a CUDA build beside the CPU torch), the Streaming child puts a stand-in
module in its place (see ``peer_samples._torchvision``). LitData and WebDataset do not import it.

Files: this one runs the rounds and measures from outside; ``peer_child.py`` is one system's process;
``peer_samples.py`` holds the samples, the shared batch packing and each system's writer.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer_samples import BUCKET, KEY, PACKAGES, SECRET, write_dataset

RESULTS = Path(__file__).resolve().parent / "results" / "peers.json"
CHILD = Path(__file__).resolve().with_name("peer_child.py")


# ---- the systems --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One table row: a system, how its loader runs, and the prefix its data is stored under."""

    name: str
    system: str
    workers: int
    prefix: str
    max_mapped_mb: int | None = None  # epochcache's loader.max_mapped_bytes, in MiB


def variants(args: argparse.Namespace) -> list[Variant]:
    w = args.workers
    rows = [
        Variant("epochcache thread, bytes", "epochcache", 0, "epochcache-bytes"),
        Variant("epochcache thread, tensor", "epochcache", 0, "epochcache-tensor"),
        Variant(f"epochcache {w} workers, bytes", "epochcache", w, "epochcache-bytes"),
        Variant(f"epochcache thread, bytes, maps<={args.max_mapped_mb}M", "epochcache", 0, "epochcache-bytes",
                args.max_mapped_mb),
        Variant(f"litdata {w} workers", "litdata", w, "litdata"),
        Variant(f"webdataset {w} workers", "webdataset", w, "webdataset"),
        Variant(f"streaming {w} workers", "streaming", w, "streaming"),
    ]
    return [v for v in rows if v.system in args.systems and v.max_mapped_mb != 0]


INSTALL = {"litdata": "litdata", "webdataset": "webdataset", "streaming": "mosaicml-streaming"}


# ---- this process: watching a child -------------------------------------------------------------------

def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid``'s process tree: each live process's own time and that of the children
    it has reaped (``/proc/<pid>/stat`` fields 14-17), so no process is counted twice."""
    from epochcache.tools.pss import process_tree

    ticks = 0
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # it exited while we looked: its parent has its time
            continue
        ticks += sum(int(f) for f in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


class Watcher(threading.Thread):
    """Peak PSS of a process tree (every 4th tick) and peak bytes under a cache dir (every 0.05 s).
    Once ``daemon_pid`` is set (epochcache's sync daemon, a child of the tree), also the peaks of the
    daemon's PSS and of the rest of the tree (the trainer and its workers), taken at the same ticks.
    Beside each total, the peak of its anonymous and shared-memory part: PSS less mapped files (the
    libraries, and the page cache of the shards a reader maps, which a ``read()`` reader holds outside
    its PSS)."""

    def __init__(self, pid: int, cache: Path):
        super().__init__(daemon=True)
        self.pid, self.cache = pid, cache
        self.peak_pss = self.peak_cache = self.peak_daemon_pss = self.peak_trainer_pss = 0
        self.peak_anon = self.peak_trainer_anon = 0  # PSS less mapped files: anonymous + shared memory
        self.daemon_pid: int | None = None
        self._done = threading.Event()
        self._sampling = threading.Lock()

    def run(self) -> None:
        from epochcache.cache.layout import bytes_under

        tick = 0
        while not self._done.wait(0.05):
            self.peak_cache = max(self.peak_cache, bytes_under(self.cache))
            if tick % 4 == 0:
                self.sample_pss()
            tick += 1

    def sample_pss(self) -> None:
        """Take the PSS figures now: every 0.2 s, and at each phase mark, where the child waits with
        its loader open (warm epochs of ~20 ms can fall between two ticks)."""
        from epochcache.tools.pss import tree_pss

        with self._sampling:
            whole = tree_pss(self.pid)
            self.peak_pss = max(self.peak_pss, whole.total)
            self.peak_anon = max(self.peak_anon, whole.total - whole.file)
            if self.daemon_pid is not None:
                daemon = tree_pss(self.daemon_pid)
                self.peak_daemon_pss = max(self.peak_daemon_pss, daemon.total)
                self.peak_trainer_pss = max(self.peak_trainer_pss, whole.total - daemon.total)
                trainer_files = whole.file - daemon.file
                self.peak_trainer_anon = max(self.peak_trainer_anon, whole.total - daemon.total - trainer_files)

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_variant(variant: Variant, args: argparse.Namespace, endpoint: str, work: Path) -> dict[str, Any]:
    """One child run of ``variant`` on a fresh cache dir; its measurements, summarised."""
    cache = work / "cache"
    settings = {
        "system": variant.system, "prefix": variant.prefix, "workers": variant.workers, "endpoint": endpoint,
        "max_mapped_mb": variant.max_mapped_mb,
        "cache": str(cache), "count": args.count, "size": args.size, "batch": args.batch,
        "warm_epochs": args.warm_epochs, "shard_mb": args.shard_mb, "budget": args.budget,
        "urls": (work / "webdataset-urls.txt").read_text().split() if variant.system == "webdataset" else [],
    }
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint,
           "S3_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "PYTHONWARNINGS": "ignore"}
    child_process = subprocess.Popen([sys.executable, str(CHILD), json.dumps(settings)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
    watcher = Watcher(child_process.pid, cache)
    watcher.start()
    timer = threading.Timer(args.child_timeout, kill_tree, [child_process.pid])
    timer.start()
    cpu: dict[str, float] = {}
    result: dict[str, Any] | None = None
    try:
        for line in child_process.stdout:  # type: ignore[union-attr]
            if line.startswith("MARK "):
                cpu[line.split()[1]] = tree_cpu_seconds(child_process.pid)
                watcher.sample_pss()
                child_process.stdin.write("\n")  # type: ignore[union-attr]
                child_process.stdin.flush()  # type: ignore[union-attr]
            elif line.startswith("DAEMON "):
                watcher.daemon_pid = int(line.split()[1])
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            else:  # the system's own output
                sys.stderr.write(line)
    finally:
        code = child_process.wait()
        timer.cancel()
        watcher.stop()
        shutil.rmtree(cache, ignore_errors=True)
    if result is None:  # a system that hangs or fails is a result too: the rounds go on
        why = f"no result in {args.child_timeout:.0f} s, killed" if timer.finished.is_set() else f"exit code {code}"
        why += f" after phase {list(cpu)[-1]}" if cpu else " before the start"
        print(f"{variant.name}: failed ({why}); its output is above", file=sys.stderr)
        return {"failed": why, "peak_pss_bytes": watcher.peak_pss, "peak_cache_bytes": watcher.peak_cache}
    return summarise(result, cpu, watcher, args)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (a child that hangs past ``--child-timeout``)."""
    from epochcache.tools.pss import process_tree

    for member in reversed(process_tree(pid)):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            continue


def summarise(result: dict[str, Any], cpu: dict[str, float], watcher: Watcher,
              args: argparse.Namespace) -> dict[str, Any]:
    """Rates, first batch, gaps, PSS, budget and CPU of one child run, from its batch times and marks."""
    times, started = result["times"], result["started"]
    delivered = [check["delivered"] for check in result["checks"]]
    warm = [delivered[k] / (times[k][-1] - times[k - 1][-1]) for k in range(1, len(times))]
    gaps = [times[k][0] - times[k - 1][-1] for k in range(2, len(times))]
    intervals = [b - a for epoch in times[1:] for a, b in zip(epoch, epoch[1:])]
    return {
        "cold_samples_per_s": delivered[0] / (times[0][-1] - started),
        "warm_samples_per_s": statistics.median(warm),
        "first_batch_s": result["first_batch_s"],
        **{key: result[key] for key in ("first_shard_s", "daemon_imports_s") if key in result},
        "epoch_gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "batch_interval_ms": statistics.median(intervals) * 1e3,
        "peak_pss_bytes": watcher.peak_pss, "peak_pss_anon_bytes": watcher.peak_anon,
        **({"peak_daemon_pss_bytes": watcher.peak_daemon_pss, "peak_trainer_pss_bytes": watcher.peak_trainer_pss,
            "peak_trainer_pss_anon_bytes": watcher.peak_trainer_anon} if watcher.daemon_pid is not None else {}),
        "peak_cache_bytes": watcher.peak_cache,
        "cold_cpu_us_per_sample": (cpu["cold"] - cpu["start"]) / delivered[0] * 1e6,
        "warm_cpu_us_per_sample": (cpu["warm"] - cpu["cold"]) / sum(delivered[1:]) * 1e6,
        "exact_epochs": sum(check["exact"] for check in result["checks"]),
        "epochs": len(result["checks"]),
        "checks": result["checks"],
    }


# ---- this process: the run ----------------------------------------------------------------------------

def installed(system: str) -> bool:
    return importlib.util.find_spec(PACKAGES[system]) is not None


def upload_all(prefixes: list[str], endpoint: str, work: Path, args: argparse.Namespace) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": endpoint},
                           skip_instance_cache=True)
    fs.mkdir(BUCKET)
    for prefix in prefixes:
        local = work / "remote" / prefix
        write_dataset(prefix, local, args)
        fs.put(f"{local}/", f"{BUCKET}/{prefix}/", recursive=True)
        if prefix == "webdataset":  # plain HTTP GETs need a signature: presigned URLs, one a line
            names = sorted(p.name for p in local.iterdir())
            urls = [fs.url(f"{BUCKET}/{prefix}/{name}", expires=86400) for name in names]
            (work / "webdataset-urls.txt").write_text("\n".join(urls) + "\n")
        shutil.rmtree(local)


def available(args: argparse.Namespace) -> list[Variant]:
    """The rows of ``--systems`` whose package imports here; a line for each system skipped."""
    rows = variants(args)
    for system in sorted({v.system for v in rows if not installed(v.system)}):
        print(f"{system}: not installed, skipped (pip install {INSTALL.get(system, system)})")
    return [v for v in rows if installed(v.system)]


def measure(rows: list[Variant], args: argparse.Namespace) -> dict[str, Any]:
    """Write and upload the data, then the interleaved rounds; every row's medians and raw rounds."""
    from s3server import moto_server

    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in rows}
    with moto_server() as endpoint, tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        upload_all(sorted({v.prefix for v in rows}), endpoint, Path(tmp), args)
        for number in range(args.rounds):
            for variant in rows[number % len(rows):] + rows[: number % len(rows)]:
                runs[variant.name].append(run_variant(variant, args, endpoint, Path(tmp)))
                print(f"round {number + 1}/{args.rounds}: {variant.name} done", file=sys.stderr, flush=True)
    return {name: {"median": medians(results), "rounds": results} for name, results in runs.items()}


def medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measure's median over the rounds that gave a result, the cache's peak over all rounds, and
    the count of exact epochs; empty if no round gave a result."""
    done = [r for r in results if "failed" not in r]
    if not done:
        return {}
    keys = [k for k, v in done[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in done) for k in keys if
                           all(r[k] is not None for r in done)}
    out["peak_cache_bytes_max"] = max(r["peak_cache_bytes"] for r in results)
    out["exact_epochs"] = sum(r["exact_epochs"] for r in done)
    out["epochs"] = sum(r["epochs"] for r in done)
    return out


def table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    sample_mb = (args.size + 8) / 1e6
    head = (f"{'system':<36}{'cold/s':>8}{'MB/s':>7}{'warm/s':>9}{'MB/s':>7}{'1st batch':>10}{'gap ms':>8}"
            f"{'(batch)':>8}{'PSS MB':>8}{'(anon)':>7}{'cache MB':>9}{'budget':>7}{'CPU us/sample':>15}  epochs ok")
    lines = [head]
    for name, entry in summary.items():
        m = entry["median"]
        failed = [r["failed"] for r in entry["rounds"] if "failed" in r]
        if not m:
            lines.append(f"{name:<36}failed in every round: {'; '.join(sorted(set(failed)))}")
            continue
        gap = f"{m['epoch_gap_ms']:.2f}" if "epoch_gap_ms" in m else "-"
        lines.append(
            f"{name:<36}{m['cold_samples_per_s']:>8.0f}{m['cold_samples_per_s'] * sample_mb:>7.0f}"
            f"{m['warm_samples_per_s']:>9.0f}{m['warm_samples_per_s'] * sample_mb:>7.0f}{m['first_batch_s']:>9.2f}s"
            f"{gap:>8}{m['batch_interval_ms']:>8.2f}"
            f"{m['peak_pss_bytes'] / 2**20:>8.0f}{m['peak_pss_anon_bytes'] / 2**20:>7.0f}"
            f"{m['peak_cache_bytes'] / 2**20:>9.0f}{'kept' if m['peak_cache_bytes_max'] <= args.budget else 'OVER':>7}"
            f"{m['cold_cpu_us_per_sample']:>8.0f} /{m['warm_cpu_us_per_sample']:>5.0f}"
            f"  {m['exact_epochs']}/{m['epochs']}{'' if m['exact_epochs'] == m['epochs'] else ' wrong'}"
            + (f"  ({len(failed)} of {len(entry['rounds'])} rounds failed: {'; '.join(sorted(set(failed)))})"
               if failed else "")
        )
    split = [f"{name}: daemon {m['peak_daemon_pss_bytes'] / 2**20:.0f} MiB, trainer and its workers "
             f"{m['peak_trainer_pss_bytes'] / 2**20:.0f} MiB (anon {m['peak_trainer_pss_anon_bytes'] / 2**20:.0f})"
             for name, entry in summary.items() if "peak_daemon_pss_bytes" in (m := entry["median"])]
    lines.append("(anon): peak PSS less mapped files (libraries; the page cache of mapped shards, which a read() "
                 "reader holds outside its PSS), i.e. anonymous + shared memory")
    if split:
        lines += ["peak PSS apart (the two peaks need not fall at the same moment):", *split]
    start = [f"{name}: {m['first_shard_s']:.2f}s, its imports {m['daemon_imports_s']:.2f}s" for name, entry
             in summary.items() if "daemon_imports_s" in (m := entry["median"])]
    if start:
        lines += ["first batch: the daemon's first shard published after (its imports, done before the clock):",
                  *start]
    return "\n".join(lines)


# (key, label, True where higher is better)
RATIOS = [
    ("cold_samples_per_s", "cold samples/s", True), ("warm_samples_per_s", "warm samples/s", True),
    ("first_batch_s", "first batch, s", False), ("epoch_gap_ms", "epoch gap, ms", False),
    ("peak_pss_bytes", "peak PSS, MiB", False), ("peak_pss_anon_bytes", "peak PSS (anon), MiB", False),
    ("cold_cpu_us_per_sample", "cold CPU, us/sample", False),
    ("warm_cpu_us_per_sample", "warm CPU, us/sample", False),
]


def ratios(summary: dict[str, Any]) -> str:
    """Per measure, epochcache's best row against the best peer row (ratio > 1: epochcache better)."""
    lines = [f"{'measure':<22}{'epochcache best':>36}{'best peer':>32}{'ratio':>8}"]
    for key, label, higher in RATIOS:
        rows = {name: entry["median"][key] for name, entry in summary.items() if key in entry["median"]}
        ours = {n: v for n, v in rows.items() if n.startswith("epochcache")}
        theirs = {n: v for n, v in rows.items() if not n.startswith("epochcache")}
        if not ours or not theirs:
            continue
        pick = max if higher else min
        a, b = pick(ours, key=ours.__getitem__), pick(theirs, key=theirs.__getitem__)
        ratio = ours[a] / theirs[b] if higher else theirs[b] / ours[a]
        scale = 2**-20 if key.startswith("peak_pss") else 1
        lines.append(f"{label:<22}{ours[a] * scale:>10.2f} ({a}){'':>{max(0, 24 - len(a))}}"
                     f"{theirs[b] * scale:>10.2f} ({b}){'':>{max(0, 20 - len(b))}}{ratio:>7.2f}x")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="samples (default 20000)")
    parser.add_argument("--size", type=int, default=12_288, help="bytes per sample (default 12288)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians shown (default 3)")
    parser.add_argument("--warm-epochs", type=int, default=3, help="warm epochs per run (default 3)")
    parser.add_argument("--shard-mb", type=int, default=16,
                        help="MiB per file, chunk or shard, for every system (default 16: LitData's second epoch "
                             "hung at 64)")
    parser.add_argument("--budget-mb", type=int, default=None,
                        help="local cache budget, MiB (default: 1.25x the samples' bytes, room for one copy)")
    parser.add_argument("--max-mapped-mb", type=int, default=8,
                        help="epochcache's loader.max_mapped_bytes in the row that sets it, MiB (default 8; "
                             "0 leaves that row out)")
    parser.add_argument("--systems", default=",".join(PACKAGES), help="comma-separated (default: all)")
    parser.add_argument("--dir", default=None, help="work folder for the caches (default: the temp folder)")
    parser.add_argument("--child-timeout", type=float, default=600.0,
                        help="seconds before a system's run is killed and counted as failed (default 600)")
    parser.add_argument("--out", default=str(RESULTS), help=f"JSON results file (default {RESULTS})")
    args = parser.parse_args(argv)
    for name, least in (("count", 1), ("size", 8), ("batch", 1), ("rounds", 1), ("warm_epochs", 1), ("shard_mb", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is below its least value {least}"
                         + (" (the first 8 bytes carry the sample's index)" if name == "size" else ""))
    args.systems = args.systems.split(",")
    unknown = sorted(set(args.systems) - set(PACKAGES))
    if unknown:
        parser.error(f"--systems names {unknown}: choose among {','.join(PACKAGES)}")
    args.budget = args.budget_mb * 2**20 if args.budget_mb else int(1.25 * args.count * (args.size + 8))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    rows = available(args)
    if not rows:
        print("nothing to measure: no system of --systems is installed")
        return {}
    load = [os.getloadavg()[0]]
    summary = measure(rows, args)
    load.append(os.getloadavg()[0])
    print(f"peers: {args.count} samples x {args.size} B, batch {args.batch}, medians of {args.rounds} interleaved "
          f"rounds, {args.warm_epochs} warm epochs each, budget {args.budget / 2**20:.0f} MiB, "
          f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on {os.cpu_count()} cores")
    print(table(summary, args))
    print(ratios(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load_average": load, "systems": summary}, indent=2) + "\n")
    print(f"wrote {out}")
    return summary


if __name__ == "__main__":
    main()
