"""Device benchmark: batches from the cache onto a CUDA device, against copying the same bytes alone
and against torch's DataLoader over the same samples held in RAM.

The data: ``--size`` bytes of 12 KB samples (a 3x64x64 uint8 image and an int64 label, as in
``benchmarks/loader.py``) in a local Parquet "remote", synced into a cache by the real daemon. Each
row runs ``--epochs`` warm epochs (after one that warms the page cache) of batches of 64, every
batch's tensors moved to the device (``non_blocking``), the device synchronised at each epoch's end so
that every copy counts. Rows, interleaved over ``--rounds`` rounds, medians reported:

- ceiling: the host-to-device copy alone: one batch-sized pinned tensor per batch, made once;
- torch DataLoader: a map-style Dataset over the samples in RAM (numpy arrays, a batch gathered by
  one fancy index in ``__getitems__``), shuffled, ``pin_memory=True``, 0 and 2 workers, then
  ``.to(device, non_blocking=True)``: the usual way;
- epochcache: ``EpochCachedLoader(device=..., pin_memory=...)`` on its batch thread and with 2
  workers; and pinned batches left on the host (``pin_memory`` without ``device``), which isolates
  the host side: gather plus pinning.

Per row: samples/s and GB/s of sample bytes, its share of the ceiling, the epoch gap (the wait for
an epoch's first batch after the last one of the epoch before, median), and this process's CPU time
per sample (every thread of the trainer's process; worker processes not counted).

Prints a table and writes JSON (``--out``, default ``benchmarks/results/device.json``). Needs CUDA;
``--device cpu`` runs the rows that need no pinning (a check of the script on a machine without one).

    python benchmarks/device.py [--size 1GB] [--epochs 4] [--rounds 3] [--device cuda] [--dir DIR] [--out F]

(Run as a script: it imports ``loader.py`` from beside it.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loader import BATCH, SAMPLE_BYTES, config_for, shard_columns, write_remote
from pydantic import ByteSize, TypeAdapter
from torch.utils.data import DataLoader, Dataset

import epochcache
from epochcache import EpochCachedLoader, SyncDaemon

RESULTS = Path(__file__).with_name("results") / "device.json"


class InMemory(Dataset[dict[str, torch.Tensor]]):
    """The samples in RAM, a batch gathered by one fancy index per column (torch's best case)."""

    def __init__(self, image: np.ndarray, label: np.ndarray):
        self.image, self.label = image, label

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        at = np.asarray(indices)
        return {"image": torch.from_numpy(self.image[at]), "label": torch.from_numpy(self.label[at])}


def _as_gathered(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DataLoader's collate: ``__getitems__`` already gave the batch."""
    return batch


def in_ram(cache: Path) -> InMemory:
    """Every cached sample copied out of the shards into two numpy arrays."""
    columns = shard_columns(cache)
    return InMemory(np.concatenate(columns[0::2]), np.concatenate(columns[1::2]))


def timed_epochs(make_epoch: Callable[[], Iterable[dict[str, Any]]], epochs: int, device: torch.device,
                 to_device: bool) -> dict[str, float]:
    """Run one epoch to warm up, then ``epochs`` timed ones: samples/s, epoch gap and CPU per sample."""
    rates, gaps, cpu, samples_all = [], [], 0.0, 0
    last = None
    for epoch in range(epochs + 1):
        started, cpu_started, samples = time.perf_counter(), time.process_time(), 0
        for number, batch in enumerate(make_epoch()):
            if to_device:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            now = time.perf_counter()
            if number == 0 and last is not None and epoch > 1:
                gaps.append(now - last)
            last = now
            samples += len(batch["label"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        last = time.perf_counter()
        if epoch:
            rates.append(samples / (last - started))
            cpu += time.process_time() - cpu_started
            samples_all += samples
    return {"samples_per_s": statistics.median(rates), "cpu_us_per_sample": cpu / samples_all * 1e6,
            "epoch_gap_ms": statistics.median(gaps) * 1e3 if gaps else float("nan")}


def ceiling(samples: int, pinned: bool) -> Callable[[], Iterable[dict[str, Any]]]:
    """An epoch's worth of batch-sized copies of one tensor made once (pinned on CUDA)."""
    batch = {"image": torch.zeros((BATCH, 3, 64, 64), dtype=torch.uint8, pin_memory=pinned),
             "label": torch.zeros(BATCH, dtype=torch.int64, pin_memory=pinned)}
    return lambda: (batch for _ in range(samples // BATCH))


def run_rows(cache: Path, epochs: int, device: torch.device, data: InMemory) -> dict[str, dict[str, float]]:
    """One round of every row (each loader made and closed within its row)."""
    cuda = device.type == "cuda"
    results: dict[str, dict[str, float]] = {}
    results["ceiling: pinned tensor to device"] = timed_epochs(ceiling(len(data), cuda), epochs, device, True)
    for workers in (0, 2):
        loader = DataLoader(data, batch_size=BATCH, shuffle=True, pin_memory=cuda, num_workers=workers,
                            persistent_workers=workers > 0, collate_fn=_as_gathered)
        results[f"torch DataLoader in RAM, {workers} workers"] = timed_epochs(lambda: loader, epochs, device, True)
        del loader
    rows: list[tuple[str, int, dict[str, Any], bool]] = [
        ("epochcache thread, device, pinned", 0, {"device": str(device), "pin_memory": True}, cuda),
        ("epochcache thread, device, not pinned", 0, {"device": str(device), "pin_memory": False}, True),
        ("epochcache 2 workers, device, pinned", 2, {"device": str(device), "pin_memory": True}, cuda),
        ("epochcache 2 workers, device, not pinned", 2, {"device": str(device), "pin_memory": False}, True),
        ("epochcache thread, pinned on host", 0, {"pin_memory": True}, cuda),
    ]
    for name, workers, options, runs in rows:
        if not runs:
            continue
        with EpochCachedLoader(cache, batch_size=BATCH, num_workers=workers, progress=False, **options) as loader:
            results[name] = timed_epochs(lambda: loader, epochs, device, False)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="bytes of samples (default 1GB)")
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs per row and round (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row, interleaved (default 3)")
    parser.add_argument("--shard-bytes", default="64MB", help="cache.shard_bytes (default 64MB, the default)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the script")
    parser.add_argument("--dir", help="work dir: a cache already there (from an earlier run) is used as it is")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu to check the script without one")
    size = int(TypeAdapter(ByteSize).validate_python(args.size))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.dir or tmp)
        if not (work / "cache").exists():
            write_remote(work / "remote", size)
            config = config_for(work / "remote", work / "cache", size, args.shard_bytes)
            SyncDaemon(config, progress=False).run(once=True)
        data = in_ram(work / "cache")
        rounds = [run_rows(work / "cache", args.epochs, device, data) for _ in range(args.rounds)]
    report(rounds, len(data), device, args)


def report(rounds: list[dict[str, dict[str, float]]], samples: int, device: torch.device,
           args: argparse.Namespace) -> None:
    rows = {name: {key: statistics.median(r[name][key] for r in rounds) for key in rounds[0][name]}
            for name in rounds[0]}
    top = rows["ceiling: pinned tensor to device"]["samples_per_s"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"\n{samples:,} samples of {SAMPLE_BYTES:,} B to {device} ({name}), batch {BATCH}, "
          f"epochcache at {Path(epochcache.__file__).parent}; medians of {len(rounds)} rounds x {args.epochs} epochs")
    print(f"{'row':40} {'samples/s':>11} {'GB/s':>6} {'of ceiling':>10} {'gap ms':>7} {'CPU us/sample':>13}")
    for row, r in rows.items():
        rate = r["samples_per_s"]
        print(f"{row:40} {rate:11,.0f} {rate * SAMPLE_BYTES / 1e9:6.2f} {rate / top:10.0%} "
              f"{r['epoch_gap_ms']:7.2f} {r['cpu_us_per_sample']:13.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": name, "samples": samples, "sample_bytes": SAMPLE_BYTES, "batch": BATCH, "epochs": args.epochs,
        "rounds": len(rounds), "torch": torch.__version__, "epochcache": str(Path(epochcache.__file__).parent),
        "rows": rows, "per_round": rounds,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
