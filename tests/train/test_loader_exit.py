"""A loader left open never holds up the process's exit; close() stops an epoch still iterated, and a
closed loader says so when iterated again.

Before: with the batch thread (no workers), a script that ended after a whole epoch, a ``break`` or
with an epoch's iterator kept hung at exit (Python joined the batch thread, which waited for the
consumer), and ``close()`` with an epoch's iterator unfinished hung the same way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import fsspec
import pytest
from conftest import wait_for, write_parquet_dataset

from epochcache import EpochCachedLoader, Ledger, SyncDaemon, load_config
from epochcache.cache.layout import CacheLayout
from epochcache.errors import LoaderError
from epochcache.train.orphans import end_with_parent

pytestmark = pytest.mark.slow  # (each a trainer process: 3-5 s)

SCRIPT = str(Path(__file__).parents[1] / "unclosed_proc.py")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A cache of 768 rows in 6 files (the shape test_loader.py uses), built once for the module."""
    root = tmp_path_factory.mktemp("exit")
    write_parquet_dataset(fsspec.filesystem("file"), str(root / "remote"), files=6, rows_per_file=128,
                          rows_per_group=32)
    config = load_config(None, {"source.url": str(root / "remote"), "cache.dir": str(root / "cache"),
                                "cache.max_bytes": "20MB", "cache.shard_bytes": "64KiB"})
    SyncDaemon(config, progress=False).run(once=True)
    return str(root / "cache")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["epoch", "break", "iter"])
def test_a_script_that_leaves_its_loader_open_exits(cache_dir: str, workers: int, mode: str) -> None:
    done = subprocess.run([sys.executable, SCRIPT, cache_dir, str(workers), mode], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "done"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]


def test_no_batch_is_being_built_when_python_finalizes(cache_dir: str, tmp_path: Path) -> None:
    # A daemon batch thread still in native code when Python finalizes is ended as it takes the GIL
    # back, and through Arrow's C++ frames that aborted the process (exit 134) about 1 run in 100:
    # the exit now waits for the job the thread is on, and the thread builds nothing after it.
    log = tmp_path / "transform.log"
    done = subprocess.run([sys.executable, SCRIPT, cache_dir, "0", "slow", str(log)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]
    lines = log.read_text().split()
    assert lines.count("start") >= 2, "a batch was being built ahead as the script ended"
    assert lines.count("end") == lines.count("start"), f"a transform cut short at exit: {lines}"


@pytest.mark.parametrize("workers", [0, 2])
def test_close_stops_an_epoch_still_iterated_and_releases_its_lease(cache_dir: str, workers: int) -> None:
    loader = EpochCachedLoader(cache_dir, batch_size=16, num_workers=workers, prefetch_batches=2, progress=False)
    epoch = iter(loader)
    next(epoch)
    closing = threading.Thread(target=loader.close)  # (a thread: a hang fails the test, not the run)
    closing.start()
    closing.join(timeout=120)
    assert not closing.is_alive(), "close() hung with an epoch's iterator unfinished"
    with pytest.raises(StopIteration):
        next(epoch)
    with pytest.raises(LoaderError, match="closed.*make a new one"):
        next(iter(loader))
    ledger = Ledger(CacheLayout(Path(cache_dir)).ledger)
    try:
        assert ledger.leases.live() == []
    finally:
        ledger.close()



def test_the_workers_of_a_killed_trainer_end_with_it(cache_dir: str) -> None:
    """Before: both workers stayed, orphaned, blocked for good (one writing to the pipe whose read end
    the other had inherited), holding their shard mappings and the slots' shared memory."""
    trainer = subprocess.Popen([sys.executable, SCRIPT, cache_dir, "2", "hold"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        workers = json.loads(trainer.stdout.readline())  # type: ignore[union-attr]
        assert len(workers) == 2
    finally:
        trainer.kill()
        trainer.wait()

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    assert wait_for(lambda: all(gone(pid) for pid in workers), timeout=30)


def test_a_worker_whose_trainer_died_before_it_asked_is_killed_at_once() -> None:
    child = os.fork()
    if child == 0:  # (the child only asks and exits: nothing of the test's threads is touched)
        end_with_parent(-1)  # not its parent's pid: as if the trainer had died before the request
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
