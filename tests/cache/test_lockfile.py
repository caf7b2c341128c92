"""The daemon lock belongs to the process that took it, not to the processes it forks.

A flock is held by the open file that took it, which a forked child shares: a loader's worker
processes forked while a daemon runs in a thread of the trainer would keep the cache locked after
that daemon stopped (a daemon started again refused, a waiting loader told a daemon runs)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from epochcache.cache.lockfile import exclusive, holder

# Asks who holds the lock as fast as it can until its stdin closes (a trainer waiting for a daemon).
_PROBING = """
import sys, threading
from epochcache.cache.lockfile import holder
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("probing", flush=True)
while not done.is_set():
    holder(sys.argv[1])
"""


def _child(started: Any, done: Any) -> None:
    started.set()  # (after the fork's handlers ran)
    done.wait(30)


def test_a_process_forked_while_the_lock_is_held_does_not_keep_it(tmp_path: Path) -> None:
    lock = tmp_path / "daemon.lock"
    fork = multiprocessing.get_context("fork")
    started, done = fork.Event(), fork.Event()
    child = fork.Process(target=_child, args=(started, done))
    try:
        with exclusive(lock):
            child.start()  # (as a DataLoader forks its workers)
            assert started.wait(30)
            assert holder(lock) == os.getpid()
        assert holder(lock) is None, "the child forked under the lock still holds it"
        with exclusive(lock):  # a daemon started again takes it
            pass
    finally:
        done.set()
        child.join(30)
    assert child.exitcode == 0


def test_a_daemon_starting_while_another_process_asks_who_holds_the_lock_takes_it(tmp_path: Path) -> None:
    lock = tmp_path / "daemon.lock"
    lock.touch()
    probe = subprocess.Popen([sys.executable, "-c", _PROBING, str(lock)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout is not None and probe.stdout.readline() == "probing\n"
        for _ in range(100):
            with exclusive(lock):  # a probe holding it shared for an instant is not a daemon
                assert holder(lock) == os.getpid()
    finally:
        assert probe.stdin is not None
        probe.stdin.close()
        probe.wait(30)
    assert probe.returncode == 0
