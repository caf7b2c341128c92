"""A training script that never closes its loader, for tests/train/test_loader_exit.py.

``python unclosed_proc.py CACHE_DIR WORKERS MODE``: ``epoch`` iterates one whole epoch (the loader
then prepares the next, and its batch thread fills the places ahead), ``break`` leaves an epoch
after a few batches, ``iter`` keeps an epoch's iterator after its first batch; then prints ``done``
and returns without ``close()``. ``hold``: with a transform whose batches go through the workers'
pipe (numpy arrays, 256 KiB each: the pipe fills), prints the worker processes' pids as JSON after
the first batch and waits on stdin (the test kills it). ``slow LOG``: as ``iter``, with a transform
that takes 0.3 s (sleeping, without the GIL) and appends ``start`` and ``end`` lines to ``LOG``.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from typing import Any

import numpy as np

from epochcache import EpochCachedLoader


def _through_the_pipe(batch: dict[str, Any]) -> dict[str, Any]:
    return {"blob": np.zeros((16, 16384), np.uint8)}


class _Slow:
    """A transform that takes 0.3 s outside the GIL, its start and end appended to ``log``."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        with open(self.log, "a") as out:
            out.write("start\n")
        time.sleep(0.3)
        with open(self.log, "a") as out:
            out.write("end\n")
        return batch


def main(cache_dir: str, workers: int, mode: str, log: str = "") -> None:
    transform = _through_the_pipe if mode == "hold" else _Slow(log) if mode == "slow" else None
    loader = EpochCachedLoader(cache_dir, batch_size=16, num_workers=workers, prefetch_batches=2, progress=False,
                               transform=transform)
    if mode == "epoch":
        for _ in loader:
            pass
    elif mode == "break":
        for number, _ in enumerate(loader):
            if number == 2:
                break
    else:
        epoch = iter(loader)
        next(epoch)
        main.epoch = epoch  # type: ignore[attr-defined]  # held until the interpreter exits
        if mode == "hold":
            print(json.dumps([child.pid for child in multiprocessing.active_children()]), flush=True)
            sys.stdin.read()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
