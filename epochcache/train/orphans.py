"""Worker processes that end with their trainer.

A trainer killed outright (SIGKILL, the OOM killer, a node agent) cannot stop its worker processes.
They would stay, blocked for good: on a pipe to the trainer that another worker (which inherited its
read end through the fork) keeps open, or waiting for an epoch that never comes, holding their
shard mappings (the disk blocks of evicted shards) and the batch slots' shared memory. Invariant:
on Linux a worker is killed by the kernel as soon as the trainer that forked it is gone, including
when the trainer died before the worker asked for it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1  # prctl(2)


def end_with_parent(parent: int, libc: Any = None) -> bool:
    """In a process just forked from ``parent`` (its pid, read before the fork): ask the kernel to
    SIGKILL it once the forking thread of ``parent`` ends (the trainer's main thread: its exit is the
    process's), and kill it now if ``parent`` is already gone. False where the platform has no such
    request (not Linux): nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    prctl = getattr(libc if libc is not None else ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died between the fork and the request: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
    return True
