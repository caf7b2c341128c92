"""The cache under real processes: kill -9 of the daemon, two trainers under a watched budget, a
killed trainer's lease. The daemon runs as ``python -m epochcache sync``, trainers as
``tests/trainer_proc.py``, all on a local Parquet remote."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import fsspec
import pytest
import yaml
from conftest import wait_for, write_parquet_dataset

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.repair import Repairs, check
from epochcache.cache.shards import open_shard
from epochcache.cli import main

TRAINER = str(Path(__file__).parents[1] / "trainer_proc.py")
CRASH = str(Path(__file__).parents[1] / "crash_proc.py")
ROW_BYTES = 3 * 16 * 16 + 8  # one sample of make_table: a 3x16x16 uint8 image and an int64 id


def _config(tmp_path: Path, files: int, rows_per_file: int, rows_per_group: int, **cache: Any) -> Path:
    write_parquet_dataset(fsspec.filesystem("file"), str(tmp_path / "remote"), files, rows_per_file, rows_per_group)
    sampler = cache.pop("sampler", {})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"source": {"url": "remote"}, "cache": {"dir": "cache", **cache},
                                    "sampler": sampler}))
    return path


def _daemon(config: Path, log: IO[bytes], *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "epochcache", "sync", "-c", str(config), "--no-progress", *extra],
                            stdout=log, stderr=log)


def _trainer(cache_dir: Path, ttl: float, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, TRAINER, str(cache_dir), str(ttl), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    """Processes a test starts; any still running at its end are killed."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _started(ledger: Ledger, pid: int) -> bool:
    """The daemon ``pid`` has reconciled the cache dir and is running its publisher."""
    state = ledger.daemon.status()
    return state is not None and state["pid"] == pid


def _bytes_under(root: Path) -> int:
    """Bytes of the files under ``root``, each inode once: a listing that races a rename (the shard's
    temp file to its name) can see one file under both names, which is not twice the bytes on disk."""
    sizes: dict[tuple[int, int], int] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                stat = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue  # deleted between the listing and the stat
            sizes[stat.st_dev, stat.st_ino] = stat.st_size
    return sum(sizes.values())


@pytest.mark.soak
def test_kill_9_daemon_30_times(tmp_path: Path, procs: list[subprocess.Popen[Any]]) -> None:
    files, rows = 32, 256
    config = _config(tmp_path, files, rows, 16, max_bytes="50MB", shard_bytes="64KiB",
                     sampler={"max_bytes_per_s": "400KB", "concurrency": 2})
    layout = CacheLayout.create(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    rng = random.Random(4)
    debris = []
    with open(tmp_path / "daemon.log", "wb") as log:
        for life in range(30):
            proc = _daemon(config, log)
            procs.append(proc)
            wait_for(lambda p=proc: _started(ledger, p.pid) or p.poll() is not None, timeout=30)
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()[-2000:]
            # After every restart: nothing wrong (the one temp file of the shard in progress aside),
            # every recorded shard whole, and no unit held by two shards.
            assert check(layout, ledger, checksums=True, live=True) == Repairs(), f"life {life}"
            units = [unit for record in ledger.shards() for unit in record.units]
            assert len(units) == len(set(units)), f"life {life}: a unit is cached twice"
            time.sleep(rng.uniform(0.0, 0.6))  # the random moment of the kill, not a synchronisation
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            debris.append(len(list(layout.shards.glob("*.tmp"))))
    # The sampler neither skipped nor repeated: finishing the pass yields every sample exactly once.
    cached_before = ledger.usage().rows
    assert 0 < cached_before < files * rows, "the kills must land before the pass is complete"
    finish = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config), "--once",
                             "--no-progress", "--set", "sampler.max_bytes_per_s=null"],
                            capture_output=True, text=True, timeout=120)
    assert finish.returncode == 0, finish.stderr
    ids = sorted(int(i) for r in ledger.shards() for i in open_shard(layout.shards / r.filename)["id"].to_pylist())
    assert ids == list(range(files * rows))
    verify = subprocess.run([sys.executable, "-m", "epochcache", "verify", "-c", str(config), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and json.loads(verify.stdout)["problems"] == 0, verify.stdout + verify.stderr
    adopted = ledger.counters.all().get("adopted", 0)
    print(f"kills with a temp file left: {sum(1 for d in debris if d)}/30; "
          f"adopted shards: {adopted}; samples cached before the last run: {cached_before}")
    ledger.close()


@pytest.mark.slow  # (daemon processes: 2 s each)
@pytest.mark.parametrize("where, found", [("write", Repairs(temp_files=1)), ("publish", Repairs(adopted=1))])
def test_kill_9_mid_write_and_before_publish(
    tmp_path: Path, procs: list[subprocess.Popen[Any]], where: str, found: Repairs
) -> None:
    files, rows = 4, 256
    config = _config(tmp_path, files, rows, 32, max_bytes="50MB", shard_bytes="64KiB")
    layout = CacheLayout.create(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    crash = subprocess.Popen([sys.executable, CRASH, str(config), where], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(crash)
    assert crash.stdout is not None and crash.stdout.readline().strip() == "blocked"
    crash.send_signal(signal.SIGKILL)
    crash.wait(30)
    assert check(layout, ledger) == found  # the debris of the kill, found before any repair
    assert ledger.shards() == []

    finish = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config), "--once", "--no-progress"],
                            capture_output=True, text=True, timeout=120)
    assert finish.returncode == 0, finish.stderr
    assert f"reconciled {layout.root}" in finish.stderr  # repaired at start, and said so
    assert check(layout, ledger, checksums=True) == Repairs()
    assert ledger.counters.all().get("adopted", 0) == found.adopted
    units = [unit for record in ledger.shards() for unit in record.units]
    assert len(units) == len(set(units)) == files * rows // 32
    ids = sorted(int(i) for r in ledger.shards() for i in open_shard(layout.shards / r.filename)["id"].to_pylist())
    assert ids == list(range(files * rows))
    ledger.close()


@pytest.mark.slow
def test_two_trainers_never_see_the_budget_overrun(tmp_path: Path, procs: list[subprocess.Popen[Any]]) -> None:
    files, rows = 10, 1024
    dataset = files * rows * ROW_BYTES
    budget = dataset // 4
    config = _config(tmp_path, files, rows, 64, max_bytes=budget, shard_bytes="200KB")
    cache = tmp_path / "cache"
    layout = CacheLayout.create(cache)
    ledger = Ledger(layout.ledger)
    samples: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            samples.append(_bytes_under(cache))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with open(tmp_path / "daemon.log", "wb") as log:
        daemon = _daemon(config, log)
        procs.append(daemon)
        trainers = [_trainer(cache, 2.0, "15") for _ in range(2)]
        procs.extend(trainers)
        outputs = [t.communicate(timeout=240) for t in trainers]
        evicted = ledger.counters.all().get("evicted", 0)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    done.set()
    watcher.join(10)
    for trainer, (out, err) in zip(trainers, outputs, strict=True):
        assert trainer.returncode == 0, err[-3000:]
        epochs = [json.loads(line) for line in out.splitlines()]
        assert len(epochs) == 15 and all(e["samples"] == e["ids"] > 0 for e in epochs)
    overruns = sum(1 for s in samples if s > budget)
    print(f"budget {budget} bytes ({budget / dataset:.0%} of the dataset): {len(samples)} samples, "
          f"max {max(samples)} bytes, {overruns} overruns, {evicted} shards evicted meanwhile")
    assert len(samples) > 50 and evicted > 0
    assert overruns == 0, f"max {max(samples)} > {budget}"
    ledger.close()


@pytest.mark.slow
def test_killed_trainer_lease_expires_and_eviction_resumes(
    tmp_path: Path, procs: list[subprocess.Popen[Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, 8, 1024, 64, max_bytes="2MB", shard_bytes="200KB")
    cache = tmp_path / "cache"
    full = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config), "--once", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert full.returncode == 0, full.stderr
    layout = CacheLayout.create(cache)
    ledger = Ledger(layout.ledger)
    trainer = _trainer(cache, 1.5, "hold")
    procs.append(trainer)
    assert trainer.stdout is not None and json.loads(trainer.stdout.readline()) == {"holding": True}
    (lease,) = [lease for lease in ledger.leases.live() if f":{trainer.pid}:" in lease["owner"]]
    held = set(lease["shards"])
    assert held == {r.id for r in ledger.shards()}  # the budget is full of leased shards

    with open(tmp_path / "daemon.log", "wb") as log:
        daemon = _daemon(config, log)
        procs.append(daemon)
        wait_for(lambda: (ledger.daemon.status() or {}).get("state") == "backpressure", timeout=30)
        assert ledger.counters.all().get("evicted", 0) == 0
        assert main(["status", "-c", str(config), "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["daemon"].startswith(f"running pid {daemon.pid}: backpressure for")
        (shown,) = status["leases"]
        assert f":{trainer.pid}:" in shown["owner"] and shown["shards"] == len(held)
        assert shown["age_s"] >= 0 and 0 <= shown["expires_in_s"] <= 1.5
        assert held <= {r.id for r in ledger.shards()} and all((layout.shards / r.filename).exists()
                                                               for r in ledger.shards())
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        wait_for(lambda: ledger.counters.all().get("evicted", 0) > 0, timeout=30)  # the lease expired
        wait_for(lambda: held - {r.id for r in ledger.shards()}, timeout=30)
        wait_for(lambda: ledger.daemon.status()["state"] == "running", timeout=30)
        assert ledger.leases.live() == []
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    assert ledger.usage().total <= 2_000_000 and _bytes_under(cache) <= 2_000_000
    ledger.close()
