"""Peer comparison: epochcache against LitData, WebDataset and MosaicML Streaming on the same samples,
read from a moto S3 server on loopback. Prints one table, writes ``benchmarks/results/peers.json``.

The samples: ``--count`` (20,000) random, incompressible byte strings of ``--size`` (12,288) bytes, each
stamped with its index in its first 8 bytes, plus an int64 label (the index). Each system gets them in
its own format, uploaded to the server under its own prefix: epochcache Arrow IPC files (a ``binary``
column, or a ``fixed_size_list<uint8>`` one for the "tensor" row), LitData ``litdata.optimize`` chunks,
WebDataset tar shards, Streaming MDS shards; files, chunks and shards of ``--shard-mb`` (64) each.

What each system does: every system delivers the same batch, ``{"image": uint8 tensor (64, size),
"label": int64 tensor (64,)}``. The peers yield each sample's raw bytes and label, and one collate
function (``collate``) builds the batch: one copy of the bytes into a new tensor. epochcache's rows
marked "bytes" yield a batch of zero-copy byte buffers that the same packing code (``pack_images``)
turns into the tensor, as the loader's ``transform``; its "tensor" row stores the images as a
fixed-size list column, which the loader gathers into the batch tensor itself (its native path).
Peers use a torch ``DataLoader`` (LitData's and Streaming's own subclasses) with ``--workers`` (2)
persistent workers, shuffling on (WebDataset: shard shuffle plus a 1,000-sample buffer). epochcache
runs its loader with a background batch thread (``thread``) and with ``--workers`` worker processes.
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
  cache with the daemon and a loader started together, without ``min_samples``;
- epoch gap: median time from an epoch's last batch to the next one's first, between warm epochs;
- peak PSS: the child's whole process tree (workers, the daemon, curl pipes), sampled every ~0.2 s by
  this process with ``epochcache.tools.pss``;
- budget: each system is given ``--budget-mb`` where it has a knob (epochcache ``cache.max_bytes``,
  LitData ``max_cache_size``, WebDataset ``cache_size``, Streaming ``cache_limit``); the bytes of the
  files under its cache dir are summed every ~0.05 s and the peak compared to it;
- client CPU per sample: user + system CPU of the child's process tree per sample delivered, per phase,
  read from ``/proc`` while the child waits at the phase boundary.

Rounds (``--rounds``, 3) run every system once each, the order rotated each round so that load drifts
hit all alike; the table shows medians. Peers that are not installed are skipped with a line saying so.

Install the peers in their own venv (never in the project's), torch's CPU build first::

    python3 -m venv /work/peers-venv
    /work/peers-venv/bin/pip install torch==2.13.0
    /work/peers-venv/bin/pip install -e '.[test]' litdata webdataset mosaicml-streaming
    /work/peers-venv/bin/python benchmarks/peers.py [--count 20000] [--size 12288] [--rounds 3]
        [--warm-epochs 3] [--workers 2] [--shard-mb 64] [--budget-mb N] [--systems epochcache,litdata,...]

If pip then wants another torch (torchvision does, through LitData), pass a constraints file holding
``torch==2.13.0``. mosaicml-streaming imports torchvision for its image datasets only; without a
torchvision that loads, the Streaming child puts a stand-in module in its place (see ``_torchvision``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "peers.json"
BUCKET = "bench"
KEY = SECRET = "bench"
SEED = 0
ROWS_PER_RECORD_BATCH = 512
Batch = dict[str, Any]


# ---- the samples --------------------------------------------------------------------------------------

def sample(index: int, size: int) -> bytes:
    """Sample ``index``: ``size`` random bytes (the same on every call), the first 8 its index."""
    payload = np.random.default_rng([SEED, index]).integers(0, 256, size, dtype=np.uint8)
    payload[:8] = np.frombuffer(np.int64(index).tobytes(), np.uint8)
    return payload.tobytes()


def pack_images(images: Sequence[Any]) -> Any:
    """Raw byte strings (bytes or any buffer) -> one uint8 tensor ``(len(images), size)``: one copy."""
    import torch

    rows = np.concatenate([np.frombuffer(image, np.uint8) for image in images])
    return torch.from_numpy(rows.reshape(len(images), -1))


def collate(samples: list[dict[str, Any]]) -> Batch:
    """The peers' collate: per-sample ``{"image": bytes, "label": int}`` -> the batch every system yields."""
    import torch

    return {
        "image": pack_images([s["image"] for s in samples]),
        "label": torch.tensor([int(s["label"]) for s in samples], dtype=torch.int64),
    }


def bytes_to_tensor(batch: Batch) -> Batch:
    """epochcache's transform for the "bytes" rows: its zero-copy buffers through the same packing."""
    return {"image": pack_images(batch["image"]), "label": batch["label"]}


# ---- the systems --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One table row: a system, how its loader runs, and the prefix its data is stored under."""

    name: str
    system: str
    workers: int
    prefix: str


def variants(args: argparse.Namespace) -> list[Variant]:
    w = args.workers
    rows = [
        Variant("epochcache thread, bytes", "epochcache", 0, "epochcache-bytes"),
        Variant("epochcache thread, tensor", "epochcache", 0, "epochcache-tensor"),
        Variant(f"epochcache {w} workers, bytes", "epochcache", w, "epochcache-bytes"),
        Variant(f"litdata {w} workers", "litdata", w, "litdata"),
        Variant(f"webdataset {w} workers", "webdataset", w, "webdataset"),
        Variant(f"streaming {w} workers", "streaming", w, "streaming"),
    ]
    return [v for v in rows if v.system in args.systems]


PACKAGES = {"epochcache": "epochcache", "litdata": "litdata", "webdataset": "webdataset",
            "streaming": "streaming"}
INSTALL = {"litdata": "litdata", "webdataset": "webdataset", "streaming": "mosaicml-streaming"}


# ---- writing the remote (this process) ----------------------------------------------------------------

def write_dataset(prefix: str, local: Path, args: argparse.Namespace) -> None:
    """The samples in ``prefix``'s format under the local folder ``local`` (uploaded afterwards)."""
    local.mkdir(parents=True)
    WRITERS[prefix.split("-")[0]](prefix, local, args)


def write_epochcache(prefix: str, local: Path, args: argparse.Namespace) -> None:
    """Arrow IPC files of about ``shard_mb`` each, record batches of 512 rows (the daemon's units)."""
    import pyarrow as pa

    kind = pa.binary() if prefix.endswith("bytes") else pa.list_(pa.uint8(), args.size)
    schema = pa.schema([("image", kind), ("label", pa.int64())])
    per_file = max(ROWS_PER_RECORD_BATCH, args.shard_mb * 2**20 // args.size)
    for number, first in enumerate(range(0, args.count, per_file)):
        with pa.ipc.new_file(str(local / f"part-{number:04d}.arrow"), schema) as writer:
            for start in range(first, min(first + per_file, args.count), ROWS_PER_RECORD_BATCH):
                indices = range(start, min(start + ROWS_PER_RECORD_BATCH, first + per_file, args.count))
                writer.write_batch(record_batch(indices, kind, schema, args.size))


def record_batch(indices: range, kind: Any, schema: Any, size: int) -> Any:
    import pyarrow as pa

    data = pa.py_buffer(b"".join(sample(i, size) for i in indices))
    if pa.types.is_binary(kind):
        offsets = pa.py_buffer(np.arange(0, (len(indices) + 1) * size, size, dtype=np.int32).tobytes())
        images = pa.Array.from_buffers(kind, len(indices), [None, offsets, data])
    else:
        images = pa.FixedSizeListArray.from_arrays(pa.Array.from_buffers(pa.uint8(), len(data), [None, data]), size)
    labels = pa.array(np.asarray(indices, dtype=np.int64))
    return pa.record_batch([images, labels], schema=schema)


def _litdata_item(index_and_size: tuple[int, int]) -> dict[str, Any]:
    index, size = index_and_size
    return {"image": sample(index, size), "label": index}


def write_litdata(_: str, local: Path, args: argparse.Namespace) -> None:
    """``litdata.optimize`` chunks of ``shard_mb``; ``image`` is stored with LitData's bytes serializer."""
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=[(i, args.size) for i in range(args.count)], output_dir=str(local),
                     chunk_bytes=args.shard_mb * 2**20, num_workers=1, verbose=False)


def write_webdataset(_: str, local: Path, args: argparse.Namespace) -> None:
    """Tar shards of ``shard_mb``, members ``<key>.bin`` (the bytes) and ``<key>.cls`` (the label)."""
    import webdataset as wds

    with wds.ShardWriter(str(local / "shard-%06d.tar"), maxsize=args.shard_mb * 2**20, maxcount=10**9,
                         verbose=0) as sink:
        for i in range(args.count):
            sink.write({"__key__": f"{i:08d}", "bin": sample(i, args.size), "cls": i})


def write_streaming(_: str, local: Path, args: argparse.Namespace) -> None:
    """MDS shards of ``shard_mb``, uncompressed, columns ``image: bytes`` and ``label: int64``."""
    MDSWriter = import_streaming().MDSWriter

    with MDSWriter(out=str(local), columns={"image": "bytes", "label": "int64"},
                   size_limit=args.shard_mb * 2**20) as writer:
        for i in range(args.count):
            writer.write({"image": sample(i, args.size), "label": i})


WRITERS: dict[str, Callable[[str, Path, argparse.Namespace], None]] = {
    "epochcache": write_epochcache, "litdata": write_litdata, "webdataset": write_webdataset,
    "streaming": write_streaming,
}


# ---- one system in a child process --------------------------------------------------------------------

class Parent:
    """The child's line to this process: phase marks (the parent reads the CPU while the child waits)."""

    def mark(self, phase: str) -> None:
        print(f"MARK {phase}", flush=True)
        sys.stdin.readline()

    def result(self, result: dict[str, Any]) -> None:
        print("RESULT " + json.dumps(result), flush=True)


def child(args: argparse.Namespace) -> None:
    """Run one variant: imports first (not timed), then the cold epoch, the warm epochs, and for
    epochcache the separate first-batch measurement; report the batch times."""
    import torch

    torch.set_num_threads(1)  # the same for all: the batches are built by the loaders, not torch ops
    system = args.child
    import_streaming() if system == "streaming" else importlib.import_module(PACKAGES[system])
    if system == "epochcache":
        importlib.import_module("epochcache.train.loader")
    parent = Parent()
    epochs = EPOCHS[system](args)
    parent.mark("start")
    started = time.perf_counter()
    times, checks = [], []
    for number, epoch in zip(range(1 + args.warm_epochs), epochs):
        batch_times, labels = timed_epoch(epoch, args.size)
        times.append(batch_times)
        checks.append(coverage(labels, args.count))
        if number == 0:
            parent.mark("cold")
    parent.mark("warm")
    epochs.close()  # type: ignore[attr-defined]
    first_batch = epochcache_first_batch(args) if system == "epochcache" else times[0][0] - started
    parent.result({"started": started, "times": times, "checks": checks, "first_batch_s": first_batch})


def timed_epoch(epoch: Iterable[Batch], size: int) -> tuple[list[float], list[int]]:
    """Each batch's arrival time and the labels seen, checking each batch against the samples."""
    times, labels = [], []
    for batch in epoch:
        images, batch_labels = batch["image"], batch["label"]
        if images.dtype != _uint8() or tuple(images.shape) != (len(batch_labels), size):
            raise RuntimeError(f"batch of {images.dtype} {tuple(images.shape)}: expected uint8 (rows, {size})")
        stamps = images[:, :8].numpy().copy().view(np.int64).reshape(-1)
        if not np.array_equal(stamps, batch_labels.numpy()):
            raise RuntimeError("a batch's images do not carry their labels' stamps: the samples were mixed up")
        labels.append(batch_labels.numpy().copy())
        times.append(time.perf_counter())
    return times, np.concatenate(labels).tolist() if labels else []


def _uint8() -> Any:
    import torch

    return torch.uint8


def coverage(labels: list[int], count: int) -> dict[str, int]:
    """Samples delivered, distinct ones, and whether the epoch was exactly the dataset."""
    distinct = len(set(labels))
    return {"delivered": len(labels), "distinct": distinct,
            "exact": int(distinct == count == len(labels) and min(labels) == 0 and max(labels) == count - 1)}


def import_streaming() -> Any:
    """``streaming``, imported after :func:`_torchvision` has made sure its torchvision import succeeds."""
    _torchvision()
    return importlib.import_module("streaming")


def _torchvision() -> None:
    """mosaicml-streaming's ``__init__`` imports torchvision for its image datasets, which this benchmark
    does not use. Where no torchvision loads (no CPU build of it matching the installed torch), a stand-in
    module with the two names it imports takes its place; a torchvision that loads is used as it is."""
    import types

    try:
        importlib.import_module("torchvision")
        return
    except (ImportError, RuntimeError):  # absent, or a build for another torch: its operators fail to register
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    import torch.utils.data

    stand_in = {"torchvision": {}, "torchvision.datasets": {"VisionDataset": torch.utils.data.Dataset},
                "torchvision.transforms": {}, "torchvision.transforms.functional": {"to_tensor": None}}
    for name, attributes in stand_in.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() reads it
        sys.modules[name] = module


def epochcache_config(args: argparse.Namespace, cache: Path) -> Any:
    from epochcache import load_config

    return load_config(None, {
        "source.url": f"s3://{BUCKET}/{args.prefix}", "source.format": "arrow",
        "source.storage_options": {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": args.endpoint}},
        "cache.dir": str(cache), "cache.max_bytes": args.budget, "cache.shard_bytes": args.shard_mb * 2**20,
    })


def _sync(config: Any, once: bool) -> None:
    from epochcache import SyncDaemon

    SyncDaemon(config, progress=False).run(once=once)


def _start_daemon(args: argparse.Namespace, cache: Path, once: bool) -> Any:
    """The sync daemon in a process forked from this one (imports done), on a new, empty cache dir."""
    import multiprocessing

    from epochcache.cache.layout import CacheLayout

    CacheLayout.create(cache)  # the loader refuses a cache dir no daemon has made yet
    daemon = multiprocessing.get_context("fork").Process(target=_sync, args=(epochcache_config(args, cache), once))
    daemon.start()
    return daemon


def _epochcache_loader(args: argparse.Namespace, cache: Path, min_samples: int) -> Any:
    from epochcache import EpochCachedLoader

    transform = bytes_to_tensor if args.prefix.endswith("bytes") else None
    return EpochCachedLoader(cache, batch_size=args.batch, num_workers=args.workers, transform=transform,
                             min_samples=min_samples, progress=False)


def epochcache_epochs(args: argparse.Namespace) -> Iterator[Iterable[Batch]]:
    """Daemon (``run(once=True)``) and loader started together; the first epoch waits for every sample."""
    daemon = _start_daemon(args, Path(args.cache), once=True)
    with _epochcache_loader(args, Path(args.cache), args.count) as loader:
        yield _then_join(loader, daemon)
        while True:
            yield loader


def _then_join(loader: Iterable[Batch], daemon: Any) -> Iterator[Batch]:
    """The cold epoch's batches, then the daemon's end (its pass is over once the epoch could start)."""
    yield from loader
    daemon.join(120)
    if daemon.exitcode != 0:
        raise RuntimeError(f"the sync daemon exited with {daemon.exitcode}")


def epochcache_first_batch(args: argparse.Namespace) -> float:
    """Seconds from starting the daemon and a loader together on another empty cache to the first batch."""
    cache = Path(args.cache + "-first-batch")
    started = time.perf_counter()
    daemon = _start_daemon(args, cache, once=False)
    with _epochcache_loader(args, cache, 0) as loader:
        next(iter(loader))
        elapsed = time.perf_counter() - started
    daemon.terminate()  # SIGTERM: the daemon stops cleanly
    daemon.join(60)
    shutil.rmtree(cache, ignore_errors=True)
    return elapsed


def _dataloader(dataset: Any, args: argparse.Namespace, loader_class: Any = None) -> Any:
    from torch.utils.data import DataLoader

    return (loader_class or DataLoader)(dataset, batch_size=args.batch, num_workers=args.workers,
                                        collate_fn=collate, persistent_workers=args.workers > 0)


def _repeat(loader: Iterable[Batch]) -> Iterator[Iterable[Batch]]:
    while True:
        yield loader


def litdata_epochs(args: argparse.Namespace) -> Iterator[Iterable[Batch]]:
    """LitData's own downloader: boto3 for the index, obstore (its default, fastest path) for chunks."""
    import litdata
    from litdata.streaming import downloader

    # obstore refuses plain http, which the loopback server speaks (real S3 is https), and LitData fixes
    # obstore's client options in this module dict; this only adds the permission, nothing else changes.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]
    dataset = litdata.StreamingDataset(
        f"s3://{BUCKET}/{args.prefix}", cache_dir=args.cache, shuffle=True, max_cache_size=args.budget,
        storage_options={"endpoint_url": args.endpoint, "aws_access_key_id": KEY, "aws_secret_access_key": SECRET},
    )
    yield from _repeat(_dataloader(dataset, args, litdata.StreamingDataLoader))


def webdataset_epochs(args: argparse.Namespace) -> Iterator[Iterable[Batch]]:
    """Shards read over HTTP by WebDataset's own ``curl`` pipe, cached whole in ``cache_dir``."""
    import webdataset as wds

    Path(args.cache).mkdir()  # WebDataset wants its cache dir to exist
    dataset = (
        wds.WebDataset(args.urls, shardshuffle=len(args.urls), cache_dir=args.cache, cache_size=args.budget,
                       seed=SEED, empty_check=False)
        .shuffle(1000)
        .map(lambda s: {"image": s["bin"], "label": int(s["cls"])})
    )
    yield from _repeat(_dataloader(dataset, args))


def streaming_epochs(args: argparse.Namespace) -> Iterator[Iterable[Batch]]:
    streaming = import_streaming()
    streaming.base.util.clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(remote=f"s3://{BUCKET}/{args.prefix}", local=args.cache, shuffle=True,
                                         batch_size=args.batch, cache_limit=args.budget)
    yield from _repeat(_dataloader(dataset, args, streaming.StreamingDataLoader))


EPOCHS: dict[str, Callable[[argparse.Namespace], Iterator[Iterable[Batch]]]] = {
    "epochcache": epochcache_epochs, "litdata": litdata_epochs, "webdataset": webdataset_epochs,
    "streaming": streaming_epochs,
}


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


def folder_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` now (0 while it does not exist); files vanishing meanwhile skipped."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return total


class Watcher(threading.Thread):
    """Peak PSS of a process tree (every 4th tick) and peak bytes under a cache dir (every 0.05 s)."""

    def __init__(self, pid: int, cache: Path):
        super().__init__(daemon=True)
        self.pid, self.cache = pid, cache
        self.peak_pss = self.peak_cache = 0
        self._done = threading.Event()

    def run(self) -> None:
        from epochcache.tools.pss import tree_pss_bytes

        tick = 0
        while not self._done.wait(0.05):
            self.peak_cache = max(self.peak_cache, folder_bytes(self.cache))
            if tick % 4 == 0:
                self.peak_pss = max(self.peak_pss, tree_pss_bytes(self.pid))
            tick += 1

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_variant(variant: Variant, args: argparse.Namespace, endpoint: str, work: Path) -> dict[str, Any]:
    """One child run of ``variant`` on a fresh cache dir; its measurements, summarised."""
    cache = work / "cache"
    command = [sys.executable, __file__, "--child", variant.system, "--prefix", variant.prefix,
               "--workers", str(variant.workers), "--endpoint", endpoint, "--cache", str(cache),
               "--count", str(args.count), "--size", str(args.size), "--batch", str(args.batch),
               "--warm-epochs", str(args.warm_epochs), "--shard-mb", str(args.shard_mb), "--budget", str(args.budget)]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint,
           "S3_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "PYTHONWARNINGS": "ignore"}
    if variant.system == "webdataset":
        command += ["--urls", str(work / "webdataset-urls.txt")]
    child_process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    watcher = Watcher(child_process.pid, cache)
    watcher.start()
    cpu: dict[str, float] = {}
    result: dict[str, Any] | None = None
    try:
        for line in child_process.stdout:  # type: ignore[union-attr]
            if line.startswith("MARK "):
                cpu[line.split()[1]] = tree_cpu_seconds(child_process.pid)
                child_process.stdin.write("\n")  # type: ignore[union-attr]
                child_process.stdin.flush()  # type: ignore[union-attr]
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
    finally:
        code = child_process.wait()
        watcher.stop()
        shutil.rmtree(cache, ignore_errors=True)
    if code != 0 or result is None:
        raise RuntimeError(f"{variant.name}: the child exited with {code} (its error is above)")
    return summarise(result, cpu, watcher, args)


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
        "epoch_gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "batch_interval_ms": statistics.median(intervals) * 1e3,
        "peak_pss_bytes": watcher.peak_pss,
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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Write and upload the data, then the interleaved rounds; every row's medians and raw rounds."""
    from s3server import moto_server

    rows = variants(args)
    for system in sorted({v.system for v in rows} - {s for s in PACKAGES if installed(s)}):
        print(f"{system}: not installed, skipped (pip install {INSTALL.get(system, system)})")
    rows = [v for v in rows if installed(v.system)]
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in rows}
    with moto_server() as endpoint, tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        upload_all(sorted({v.prefix for v in rows}), endpoint, Path(tmp), args)
        for number in range(args.rounds):
            for variant in rows[number % len(rows):] + rows[: number % len(rows)]:
                runs[variant.name].append(run_variant(variant, args, endpoint, Path(tmp)))
                print(f"round {number + 1}/{args.rounds}: {variant.name} done", file=sys.stderr, flush=True)
    return {name: {"median": medians(results), "rounds": results} for name, results in runs.items()}


def medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in results[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in results) for k in keys if
                           all(r[k] is not None for r in results)}
    out["exact_epochs"] = sum(r["exact_epochs"] for r in results)
    out["epochs"] = sum(r["epochs"] for r in results)
    return out


def table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    sample_mb = (args.size + 8) / 1e6
    head = (f"{'system':<28}{'cold/s':>8}{'MB/s':>7}{'warm/s':>9}{'MB/s':>7}{'1st batch':>10}{'gap ms':>8}"
            f"{'(batch)':>8}{'PSS MB':>8}{'cache MB':>9}{'budget':>7}{'CPU us/sample':>15}  epochs ok")
    lines = [head]
    for name, entry in summary.items():
        m = entry["median"]
        gap = f"{m['epoch_gap_ms']:.2f}" if "epoch_gap_ms" in m else "-"
        lines.append(
            f"{name:<28}{m['cold_samples_per_s']:>8.0f}{m['cold_samples_per_s'] * sample_mb:>7.0f}"
            f"{m['warm_samples_per_s']:>9.0f}{m['warm_samples_per_s'] * sample_mb:>7.0f}{m['first_batch_s']:>9.2f}s"
            f"{gap:>8}{m['batch_interval_ms']:>8.2f}{m['peak_pss_bytes'] / 2**20:>8.0f}"
            f"{m['peak_cache_bytes'] / 2**20:>9.0f}{'kept' if m['peak_cache_bytes'] <= args.budget else 'OVER':>7}"
            f"{m['cold_cpu_us_per_sample']:>8.0f} /{m['warm_cpu_us_per_sample']:>5.0f}"
            f"  {m['exact_epochs']}/{m['epochs']}{'' if m['exact_epochs'] == m['epochs'] else ' wrong'}"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="samples (default 20000)")
    parser.add_argument("--size", type=int, default=12_288, help="bytes per sample (default 12288)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians shown (default 3)")
    parser.add_argument("--warm-epochs", type=int, default=3, help="warm epochs per run (default 3)")
    parser.add_argument("--shard-mb", type=int, default=64, help="MiB per file, chunk or shard (default 64)")
    parser.add_argument("--budget-mb", type=int, default=None,
                        help="local cache budget, MiB (default: 1.25x the samples' bytes, room for one copy)")
    parser.add_argument("--systems", default=",".join(PACKAGES), help="comma-separated (default: all)")
    parser.add_argument("--dir", default=None, help="work folder for the caches (default: the temp folder)")
    parser.add_argument("--child", choices=sorted(PACKAGES), help=argparse.SUPPRESS)
    for hidden in ("--prefix", "--endpoint", "--cache", "--urls"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = args.systems.split(",")
    if args.budget is None:
        args.budget = args.budget_mb * 2**20 if args.budget_mb else int(1.25 * args.count * (args.size + 8))
    args.urls = Path(args.urls).read_text().split() if args.urls else []
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.child:
        child(args)
        return {}
    summary = measure(args)
    print(f"peers: {args.count} samples x {args.size} B, batch {args.batch}, medians of {args.rounds} interleaved "
          f"rounds, {args.warm_epochs} warm epochs each, budget {args.budget / 2**20:.0f} MiB, "
          f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(table(summary, args))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args),
                                   "systems": summary}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return summary


if __name__ == "__main__":
    main()
