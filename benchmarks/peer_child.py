"""One system of the peer benchmark in its own process: ``python peer_child.py '<json of its settings>'``,
started by ``peers.py``, which reads its stdout.

It imports torch and its system first (not timed), prints ``MARK start`` and waits for a line on stdin
(the parent reads the process tree's CPU meanwhile), runs the cold epoch, ``MARK cold``, the warm epochs,
``MARK warm``, then (epochcache only) its separate first-batch measurement, and prints ``RESULT <json>``:
the start time, every batch's arrival time per epoch, and each epoch's coverage check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from peer_samples import BUCKET, KEY, PACKAGES, SECRET, SEED, Batch, bytes_to_tensor, collate, import_streaming


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
    system = args.system
    if system == "streaming":
        import_streaming()
    importlib.import_module(PACKAGES[system])
    if system == "epochcache":
        importlib.import_module("epochcache.train.loader")
    parent = Parent()
    epochs = EPOCHS[system](args)
    parent.mark("start")
    started = time.perf_counter()
    times, labels = [], []
    for number, epoch in zip(range(1 + args.warm_epochs), epochs):
        batch_times, batch_labels = timed_epoch(epoch, args.size)
        times.append(batch_times)
        labels.append(batch_labels)
        if number == 0:
            parent.mark("cold")
    parent.mark("warm")
    epochs.close()  # type: ignore[attr-defined]
    # checked after the last epoch: between two epochs the clock runs (the gap, the warm rate)
    checks = [coverage(np.concatenate(epoch).tolist() if epoch else [], args.count) for epoch in labels]
    first = epochcache_first_batch(args) if system == "epochcache" else {"first_batch_s": times[0][0] - started}
    parent.result({"started": started, "times": times, "checks": checks, **first})


def timed_epoch(epoch: Iterable[Batch], size: int) -> tuple[list[float], list[np.ndarray]]:
    """Each batch's arrival time and its labels, checking each batch against the samples. Nothing
    is done after the last batch: the time to the next epoch's first is the loader's alone."""
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
    return times, labels


def _uint8() -> Any:
    import torch

    return torch.uint8


def coverage(labels: list[int], count: int) -> dict[str, int]:
    """Samples delivered, distinct ones, and whether the epoch was exactly the dataset."""
    distinct = len(set(labels))
    return {"delivered": len(labels), "distinct": distinct,
            "exact": int(distinct == count == len(labels) and min(labels) == 0 and max(labels) == count - 1)}


def epochcache_config(args: argparse.Namespace, cache: Path) -> Any:
    from epochcache import load_config

    return load_config(None, {
        "source.url": f"s3://{BUCKET}/{args.prefix}", "source.format": "arrow",
        "source.storage_options": {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": args.endpoint}},
        "cache.dir": str(cache), "cache.max_bytes": args.budget, "cache.shard_bytes": args.shard_mb * 2**20,
    })


# What ``epochcache sync`` imports before its first remote read of this benchmark's remote (Arrow IPC on
# S3): the daemon's process imports them before the clock starts, since the target excludes imports;
# their time is reported apart (``daemon_imports_s``).
DAEMON_IMPORTS = ("epochcache.sync.daemon", "epochcache.sources.arrow", "epochcache.sources.objects",
                  "epochcache.sources.parquet", "epochcache.sources.webdataset", "s3fs")


def _sync(config: Any, once: bool, line: Any) -> None:
    """The daemon's process: its imports (timed, the time sent on ``line``), then, once ``line`` says
    go, one ``SyncDaemon.run``, sending on ``line`` when (``time.perf_counter()``, a clock every
    process shares) it published its first shard."""
    began = time.perf_counter()
    for name in DAEMON_IMPORTS:
        importlib.import_module(name)
    line.send(time.perf_counter() - began)
    line.recv()
    from epochcache import SyncDaemon

    published = threading.Event()

    def on_publish(_: Any) -> None:
        if not published.is_set():
            published.set()
            line.send(time.perf_counter())

    SyncDaemon(config, progress=False, on_publish=on_publish).run(once=once)


class Daemon:
    """The sync daemon in a process forked from this one (the trainer's imports done), on a new, empty
    cache dir: it does its own imports (:meth:`ready` waits for them), then its run once :meth:`start`ed."""

    def __init__(self, args: argparse.Namespace, cache: Path, once: bool):
        import multiprocessing

        from epochcache.cache.layout import CacheLayout

        CacheLayout.create(cache)  # the loader refuses a cache dir no daemon has made yet
        context = multiprocessing.get_context("fork")
        self._line, theirs = context.Pipe()
        self.process = context.Process(target=_sync, args=(epochcache_config(args, cache), once, theirs))
        self.process.start()

    def ready(self) -> float:
        """Wait until the daemon's imports are done; the seconds they took."""
        return float(self._line.recv())

    def start(self) -> None:
        self._line.send(None)

    def first_published(self) -> float:
        """When (``time.perf_counter()``) the daemon published its first shard; waits for it."""
        return float(self._line.recv())


def _epochcache_loader(args: argparse.Namespace, cache: Path, min_samples: int) -> Any:
    from epochcache import EpochCachedLoader

    transform = bytes_to_tensor if args.prefix.endswith("bytes") else None
    mapped = args.max_mapped_mb * 2**20 if args.max_mapped_mb else None
    return EpochCachedLoader(cache, batch_size=args.batch, num_workers=args.workers, transform=transform,
                             min_samples=min_samples, progress=False, max_mapped_bytes=mapped)


def epochcache_epochs(args: argparse.Namespace) -> Iterator[Iterable[Batch]]:
    """Daemon (``run(once=True)``) and loader started together; the first epoch waits for every sample."""
    daemon = Daemon(args, Path(args.cache), once=True)
    print(f"DAEMON {daemon.process.pid}", flush=True)  # the parent measures the daemon's PSS apart from the trainer's
    daemon.ready()  # the cold epoch's clock started before the daemon's imports, as before
    daemon.start()
    with _epochcache_loader(args, Path(args.cache), args.count) as loader:
        yield _then_join(loader, daemon.process)
        while True:
            yield loader


def _then_join(loader: Iterable[Batch], daemon: Any) -> Iterator[Batch]:
    """The cold epoch's batches, then the daemon's end (its pass is over once the epoch could start)."""
    yield from loader
    daemon.join(120)
    if daemon.exitcode != 0:
        raise RuntimeError(f"the sync daemon exited with {daemon.exitcode}")


def epochcache_first_batch(args: argparse.Namespace) -> dict[str, float]:
    """Seconds from starting the daemon and a loader together on another empty cache (each process's
    imports done before) to the first batch (``first_batch_s``) and to the daemon's first published
    shard (``first_shard_s``, its part of the wait), and the seconds the daemon's imports took."""
    cache = Path(args.cache + "-first-batch")
    daemon = Daemon(args, cache, once=False)
    print(f"DAEMON {daemon.process.pid}", flush=True)  # this daemon's PSS is its own too, not the trainer's
    imports = daemon.ready()
    started = time.perf_counter()
    daemon.start()
    with _epochcache_loader(args, cache, 0) as loader:
        epoch = iter(loader)  # kept: an epoch dropped at its first batch would be closed inside the timing
        next(epoch)
        elapsed = time.perf_counter() - started
        epoch.close()
    first_shard = daemon.first_published() - started
    daemon.process.terminate()  # SIGTERM: the daemon stops cleanly
    daemon.process.join(60)
    shutil.rmtree(cache, ignore_errors=True)
    return {"first_batch_s": elapsed, "first_shard_s": first_shard, "daemon_imports_s": imports}


def _dataloader(dataset: Any, args: argparse.Namespace, loader_class: Any = None) -> Any:
    """The system's DataLoader (``loader_class``, default torch's) with the shared collate, its workers
    kept across epochs (each peer's fastest setting here)."""
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


if __name__ == "__main__":
    child(argparse.Namespace(**json.loads(sys.argv[1])))
