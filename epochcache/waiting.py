"""Before the first epoch: wait until the cache holds ``loader.min_samples`` samples.

In: the cache layout and ledger; out: nothing, or a :class:`CacheEmptyError` after the timeout whose
message says whether a sync daemon runs on the cache dir (:func:`epochcache.lockfile.holder`: a
non-blocking probe of the daemon's flock, which the kernel drops when the daemon dies).
"""

from __future__ import annotations

import threading
import time

from tqdm import tqdm

from epochcache.errors import CacheEmptyError
from epochcache.layout import CacheLayout
from epochcache.ledger import Ledger
from epochcache.lockfile import holder

_POLL_S = 0.2


def daemon_running(layout: CacheLayout) -> bool:
    """Whether a sync daemon holds ``layout.lock`` now."""
    return holder(layout.lock) is not None


def wait_for_samples(
    layout: CacheLayout, ledger: Ledger, samples: int, timeout_s: float, stop: threading.Event, progress: bool
) -> None:
    """Return once ``ledger`` counts ``samples`` rows; raise :class:`CacheEmptyError` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with tqdm(total=samples, desc="waiting for cached samples", unit="sample", disable=not progress) as bar:
        while True:
            rows = ledger.usage().rows
            bar.update(min(rows, samples) - bar.n)
            if rows >= samples:
                return
            if time.monotonic() >= deadline or stop.wait(_POLL_S):
                raise CacheEmptyError(_timeout_message(layout, rows, samples, timeout_s))


def _timeout_message(layout: CacheLayout, rows: int, samples: int, timeout_s: float) -> str:
    head = f"cache {layout.root} holds {rows} samples after {timeout_s:g}s, fewer than loader.min_samples={samples}"
    if not daemon_running(layout):
        return f"{head}, and no sync daemon runs on it: start `epochcache sync` on this cache dir, or lower loader.min_samples"
    return f"{head}; its sync daemon is running: raise loader.wait_timeout_s or lower loader.min_samples"
