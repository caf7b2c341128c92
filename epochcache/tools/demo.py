"""``epochcache demo``: the whole product on one machine, no cloud account needed.

1. Generates (once) a local Parquet "remote" of image-like samples: a 3x64x64 uint8 tensor and an
   int64 label that the image's brightness encodes, so a small model can learn it. The image is
   stored in the fast layout (:mod:`epochcache.sources.layouts`): a fixed-size binary column with
   its shape in the field metadata, uncompressed, no dictionary, page checksums.
2. Writes a config.yaml for it whose budget is about half the remote, and starts
   ``epochcache sync`` on it as a background process (with a read-rate cap, so the cache visibly grows).
3. Trains a small CNN with EpochCachedLoader and prints one row per epoch: shards, samples, cache
   bytes vs budget, samples/s, the wait before the epoch's first batch, loss and accuracy.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TextIO

import numpy as np
import pyarrow as pa
import yaml

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import LEDGER_RESERVE, Ledger
from epochcache.config import load_config
from epochcache.errors import ConfigError, LoaderError
from epochcache.sources.layouts import tensor_table, write_parquet
from epochcache.tools.status import human_bytes

IMAGE_SHAPE = (3, 64, 64)
CLASSES = 10
GROUPS_PER_FILE = 4
# Row groups of at most 512 samples (~6 MB), and at least 48 of them, so the cache holds many shards.
MAX_ROWS_PER_GROUP = 512
MIN_GROUPS = 48
_MARKER = "_COMPLETE.json"
# write_config's budget (half the remote) must hold two shards of at least 64KiB plus the ledger's
# reserve twice (CacheConfig's check); the image bytes alone bound the remote's size from below.
MIN_SAMPLES = math.ceil(4 * (2**16 + LEDGER_RESERVE) / math.prod(IMAGE_SHAPE))


def generate_remote(path: Path, samples: int, seed: int = 0) -> Path:
    """Write ``samples`` rows as Parquet files under ``path`` unless an identical set is there.

    Written into a sibling temp folder and renamed, so an interrupted run never leaves a half set.
    """
    rows_per_group = max(1, min(MAX_ROWS_PER_GROUP, samples // MIN_GROUPS))
    rows_per_file = GROUPS_PER_FILE * rows_per_group
    params = {"samples": samples, "seed": seed, "rows_per_file": rows_per_file, "rows_per_group": rows_per_group,
              "layout": "fixed-size binary + shape"}
    marker = path / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == params:
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for number, start in enumerate(range(0, samples, rows_per_file)):
        write_parquet(_samples(rng, min(rows_per_file, samples - start)), tmp / f"part-{number:05d}.parquet",
                      rows_per_group)
    (tmp / _MARKER).write_text(json.dumps(params))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def _samples(rng: np.random.Generator, n: int) -> pa.Table:
    labels = rng.integers(0, CLASSES, n)
    noise = rng.integers(0, 128, (n, *IMAGE_SHAPE), dtype=np.uint8)
    images = noise + (labels * 12).astype(np.uint8)[:, None, None, None]
    return tensor_table({"image": images, "label": labels.astype(np.int64)})


def write_config(folder: Path, remote: Path, remote_bytes: int) -> Path:
    """A config.yaml for the demo: budget about half the remote, shards of about 2% of it."""
    shard_bytes = max(2**16, remote_bytes // MIN_GROUPS)
    config = {
        "source": {"url": str(remote.resolve()), "format": "parquet"},
        "cache": {"dir": str((folder / "cache").resolve()), "max_bytes": remote_bytes // 2,
                  "shard_bytes": shard_bytes, "eviction": "fifo"},
        "sampler": {"seed": 0, "concurrency": 4, "max_bytes_per_s": remote_bytes // 10},
        "loader": {"batch_size": 128, "num_workers": 0, "shuffle": True, "seed": 0},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_demo(
    folder: Path, epochs: int = 12, samples: int = 24576, out: TextIO = sys.stdout
) -> list[dict[str, float | None]]:
    """Run the demo in ``folder``; return the per-epoch rows it printed. :class:`ConfigError` naming
    the flag (``--dir``, ``--epochs``, ``--samples``) for arguments the demo cannot run with."""
    _check_args(folder, epochs, samples)
    print(f"generating the demo remote ({samples} samples) in {folder / 'remote'} (once) ...", file=out, flush=True)
    remote = generate_remote(folder / "remote", samples)
    remote_bytes = sum(p.stat().st_size for p in remote.glob("*.parquet"))
    config_path = write_config(folder, remote, remote_bytes)
    config = load_config(config_path)
    shutil.rmtree(config.cache.dir, ignore_errors=True)  # a fresh cache, so the growth is visible
    print(f"remote: {human_bytes(remote_bytes)}; cache budget: {human_bytes(int(config.cache.max_bytes))}; "
          f"config: {config_path}; daemon log: {folder / 'daemon.log'}", file=out, flush=True)
    import torch  # before the daemon starts, so its import time does not pass for a wait on the cache

    with open(folder / "daemon.log", "w") as daemon_log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "epochcache", "sync", "--config", str(config_path), "--no-progress"],
            stdout=daemon_log, stderr=subprocess.STDOUT,
        )
        try:
            rows = _train(torch, config_path, epochs, out)
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=60)
    print(f"sync daemon stopped cleanly (exit code {code})" if code == 0 else
          f"sync daemon exited with code {code}: see {folder / 'daemon.log'}", file=out, flush=True)
    return rows


def _check_args(folder: Path, epochs: int, samples: int) -> None:
    """Refuse what the demo cannot run with, before anything is generated; creates ``folder``."""
    if epochs < 1:
        raise ConfigError(f"--epochs {epochs}: the demo trains at least one epoch; give --epochs 1 or more")
    if samples < MIN_SAMPLES:
        raise ConfigError(f"--samples {samples} is too few for the demo's cache (half the remote) to hold two "
                          f"shards: give --samples {MIN_SAMPLES} or more")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--dir {str(folder)!r}: cannot create the demo folder ({exc.strerror}): "
                          "give another --dir") from exc


def _train(torch: ModuleType, config_path: Path, epochs: int, out: TextIO) -> list[dict[str, float | None]]:
    from torch import nn

    from epochcache.train.loader import EpochCachedLoader

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=4, stride=4), nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    config = load_config(config_path)
    ledger = Ledger(CacheLayout.create(config.cache.dir).ledger)
    header = (f"{'epoch':>5} {'shards':>6} {'samples':>8} {'cache bytes / budget':>24} {'evicted':>7} "
              f"{'coverage':>8} {'echo':>5} {'samples/s':>10} {'first-batch wait':>16} {'loss':>6} {'acc':>6}")
    print(header, file=out, flush=True)
    rows = []
    with EpochCachedLoader.from_config(config_path) as loader:
        for _ in range(epochs):
            seen = correct = 0
            loss_sum = 0.0
            start = time.monotonic()
            for batch in loader:
                images = batch["image"].float().div_(255.0)
                labels = batch["label"]
                logits = model(images)
                loss = nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += len(labels)
                correct += int((logits.argmax(1) == labels).sum())
                loss_sum += float(loss.detach()) * len(labels)
            elapsed = time.monotonic() - start
            info = loader.last_epoch
            if info is None:  # set by every epoch that ran; None would be a loader bug
                raise LoaderError("the demo's epoch ended without an EpochInfo (loader.last_epoch is None)")
            budget_bytes = int(config.cache.max_bytes)
            cache_bytes = ledger.usage().total
            evicted = ledger.counters.all().get("evicted", 0)
            row: dict[str, float | None] = {
                "epoch": info.epoch, "shards": info.shards, "samples": seen, "cache_bytes": cache_bytes,
                "budget": budget_bytes, "evicted": evicted, "samples_per_s": seen / elapsed,
                "first_batch_wait_s": info.first_batch_wait_s or 0.0,
                "loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1),
                "coverage": info.coverage, "echo": info.echo,
            }
            rows.append(row)
            budget = f"{human_bytes(cache_bytes)} / {human_bytes(budget_bytes)}"
            coverage = "-" if info.coverage is None else f"{info.coverage:.1%}"
            echo = "-" if info.echo is None else f"{info.echo:.2f}"
            print(f"{info.epoch:>5} {info.shards:>6} {seen:>8} {budget:>24} {evicted:>7} {coverage:>8} {echo:>5} "
                  f"{seen / elapsed:>10.0f} {(info.first_batch_wait_s or 0.0) * 1000:>14.1f}ms "
                  f"{loss_sum / max(seen, 1):>6.3f} {correct / max(seen, 1):>6.3f}",
                  file=out, flush=True)
    ledger.close()
    return rows
