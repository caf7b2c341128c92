"""Proportional set size (PSS) of a process tree, from ``/proc`` (Linux).

PSS splits each shared page among the processes mapping it, so summed over a tree of forked workers
it counts every page once: the honest measure of what a training job's loader costs in memory.

:func:`tree_pss` also splits it by kind, because a reader of memory-mapped shards and a reader of
files through ``read()`` hold the same bytes differently: the mapped pages of the shards it reads
are file-backed PSS (page cache, shared with every other reader and reclaimable by the kernel),
while a ``read()`` into a buffer is anonymous PSS (the process's own), and the page cache it read
through counts in no process's PSS at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# smaps_rollup field -> Pss attribute (kB in the file); Pss_Anon, Pss_File and Pss_Shmem add up to Pss.
_FIELDS = {"Pss:": "total", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem"}


@dataclass(frozen=True)
class Pss:
    """Bytes of PSS: ``total`` = ``anon`` (private and forked-shared memory) + ``file`` (mapped files:
    libraries, shards) + ``shmem`` (shared memory, e.g. the loader's batch slots)."""

    total: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0

    def __add__(self, other: Pss) -> Pss:
        return Pss(self.total + other.total, self.anon + other.anon, self.file + other.file, self.shmem + other.shmem)


def tree_pss(pid: int | None = None) -> Pss:
    """PSS of ``pid`` (default: this process) and all its descendants, by kind."""
    root = os.getpid() if pid is None else pid
    return sum((process_pss(p) for p in process_tree(root)), Pss())


def tree_pss_bytes(pid: int | None = None) -> int:
    """PSS of ``pid`` (default: this process) and all its descendants, in bytes."""
    return tree_pss(pid).total


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, found through each process's parent in ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name (field 2) may hold spaces; the parent pid is the 2nd field after it
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):  # it exited while we looked
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def process_pss(pid: int) -> Pss:
    """PSS of one process, by kind; all zero if it has exited meanwhile."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return Pss()
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in _FIELDS:
            values[_FIELDS[name]] = int(rest.split()[0]) * 1024
    return Pss(**values)
