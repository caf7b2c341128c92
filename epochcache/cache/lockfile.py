"""The daemon lock of a cache dir: an flock on ``daemon.lock`` holding the owner's pid.

Whoever holds it (the sync daemon, or ``epochcache verify --fix`` / ``gc``) may change files under
the cache dir besides publishing and quarantining; the kernel drops it when the holder dies.

Invariant: only the process that took the lock holds it. An flock belongs to the open file, which a
forked child shares; a child forked meanwhile (a loader's worker, with the daemon in a thread of the
trainer) closes its copy at once, or it would keep the cache locked after the daemon stopped.

Asking who holds it (:func:`holder`: a trainer waiting for a daemon, ``epochcache status``) takes the
lock shared for the time of two system calls. A daemon starting in that instant would find it
taken, so :func:`exclusive` tries again for :data:`PROBE_GRACE_S` before it calls the lock held.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from epochcache.errors import DaemonRunningError

_held: set[int] = set()  # descriptors of the locks this process holds

# How long a lock found taken is tried again: far longer than a probe holds it (microseconds, or a
# scheduler's slice on a loaded machine), short enough not to keep a refusal waiting.
PROBE_GRACE_S = 0.25


def _close_inherited() -> None:
    """In a forked child: close the copies of the parent's lock descriptors (the parent keeps its locks)."""
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_inherited)


@contextmanager
def exclusive(lock_path: os.PathLike[str], purpose: str = "epochcache sync") -> Iterator[None]:
    """Hold the lock for the block; :class:`DaemonRunningError` naming the holder if it is taken."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    _held.add(fd)
    try:
        if not _taken(fd):
            raise DaemonRunningError(
                f"{purpose}: another epochcache process (pid {_pid(fd) or 'unknown'}) holds "
                f"{os.fspath(lock_path)}: stop it first, or give this one its own cache.dir"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        _held.discard(fd)
        os.close(fd)


def _taken(fd: int) -> bool:
    """Take the lock on ``fd`` exclusively, trying again for :data:`PROBE_GRACE_S` while a probe
    (or a holder) has it; False if it is still taken then."""
    deadline = time.monotonic() + PROBE_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def holder(lock_path: os.PathLike[str]) -> int | None:
    """The pid holding the lock now (0 if unreadable), or None if nobody holds it."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid(fd) or 0
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None
