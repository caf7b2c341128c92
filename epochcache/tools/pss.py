"""Proportional set size (PSS) of a process tree, from ``/proc`` (Linux).

PSS splits each shared page among the processes mapping it, so summed over a tree of forked workers
it counts every page once: the honest measure of what a training job's loader costs in memory.
"""

from __future__ import annotations

import os
from pathlib import Path


def tree_pss_bytes(pid: int | None = None) -> int:
    """PSS of ``pid`` (default: this process) and all its descendants, in bytes."""
    root = os.getpid() if pid is None else pid
    return sum(_pss(p) for p in process_tree(root))


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


def _pss(pid: int) -> int:
    """Pss of one process in bytes; 0 if it has exited meanwhile."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0
