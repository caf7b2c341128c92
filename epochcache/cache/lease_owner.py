"""Who holds a lease: host, pid and process start time, and whether that process still lives.

Flow: :func:`this_process` -> an :class:`Owner` stored with a lease; :meth:`Owner.alive` (or None
when the owner is on another host and only its lease's TTL can tell) decides whether the lease
still protects its shards. The start time (``/proc/<pid>/stat`` field 22, clock ticks since boot)
tells a reused pid from the process that took the lease; the host name carries the boot id, so a
pid from before a reboot is never taken for a live one.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class Owner:
    """A process: ``host`` (name and boot id), ``pid``, ``started`` (its start time; 0 if unknown)."""

    host: str
    pid: int
    started: int

    def alive(self) -> bool | None:
        """True/False for a process of this host; None for another host's (its TTL decides)."""
        if self.host != this_host():
            return None
        started = start_time(self.pid)
        return started is not None and (self.started == 0 or started == self.started)


@cache
def this_host() -> str:
    """This machine's name and boot id (empty where the kernel gives none)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def this_process() -> Owner:
    pid = os.getpid()
    return Owner(this_host(), pid, start_time(pid) or 0)


def start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; 0 if it lives but /proc cannot say;
    None if there is no such process. A zombie counts as dead: it holds no mapping any more."""
    if not Path("/proc/self/stat").exists():  # no procfs (macOS): existence is all we can know
        return _exists(pid)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return _exists(pid)
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _exists(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return 0
    return 0
