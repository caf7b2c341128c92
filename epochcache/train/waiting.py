"""Waiting for shards: before the first epoch until the cache holds ``loader.min_samples`` samples,
and (see :class:`Patience`) for an epoch's first shard. What a wait waits for is a publish by the
daemon: :class:`LedgerChanges` sees it within :data:`CHANGE_POLL_S` by a probe that costs no
transaction, so the ledger's state is read again (or a snapshot taken) only once it changed.

In: the cache layout and ledger; out: nothing, or a :class:`CacheEmptyError`. A wait lasts while a
sync daemon runs on the cache dir, up to ``loader.wait_timeout_s``; with no daemon it ends after
:data:`NO_DAEMON_GRACE_S` (time for a daemon started together with the trainer to take its lock),
not the full timeout. Whether a daemon runs is :func:`epochcache.cache.lockfile.holder`: a non-blocking
probe of the daemon's flock, which the kernel drops when the daemon dies.
"""

from __future__ import annotations

import threading
import time

from tqdm import tqdm

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.lockfile import holder
from epochcache.errors import CacheEmptyError

_POLL_S = 0.2
# How often a wait probes the ledger for a commit (ledger.db.version(): no table read, no transaction), so
# an empty cache's first shard is in an epoch within milliseconds of its publish (~4 us a probe).
CHANGE_POLL_S = 0.005
# How long a wait goes on with no sync daemon running on the cache dir.
NO_DAEMON_GRACE_S = 5.0


def daemon_running(layout: CacheLayout) -> bool:
    """Whether a sync daemon holds ``layout.lock`` now."""
    return holder(layout.lock) is not None


class LedgerChanges:
    """Commits to ``ledger`` by other connections (the daemon's publishes), seen by probing
    ``ledger.db.version()`` every :data:`CHANGE_POLL_S`. Make it before the first look at the state it
    guards, so that no commit between that look and the wait goes unseen."""

    def __init__(self, ledger: Ledger):
        self._ledger = ledger
        self._seen = ledger.db.version()

    def wait(self, stop: threading.Event, timeout_s: float = _POLL_S) -> bool:
        """True as soon as the ledger changed since this object last said so (or was made); False once
        ``timeout_s`` passed without a change (by default the interval at which a wait asks its
        :class:`Patience` again), or ``stop`` is set."""
        deadline = time.monotonic() + timeout_s
        while True:
            version = self._ledger.db.version()
            if version != self._seen:
                self._seen = version
                return True
            left = deadline - time.monotonic()
            if left <= 0 or stop.wait(min(CHANGE_POLL_S, left)):
                return False


class Patience:
    """Whether a wait that began at construction should end: ``timeout_s`` after it began, or once no
    daemon has run for ``grace_s`` (a daemon seen running restarts that count)."""

    def __init__(self, layout: CacheLayout, timeout_s: float, grace_s: float | None = None):
        self._layout = layout
        self._started = self._daemon_seen = time.monotonic()
        self._deadline = self._started + timeout_s
        self._grace_s = NO_DAEMON_GRACE_S if grace_s is None else grace_s
        self._probed = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def over(self) -> str | None:
        """None while the wait should go on; else why not: "no daemon" (none runs now), or "timeout"."""
        now = time.monotonic()
        if now >= self._deadline:
            return "timeout" if daemon_running(self._layout) else "no daemon"
        if now - self._probed >= _POLL_S:  # one lock probe per poll interval, however often asked
            self._probed = now
            if daemon_running(self._layout):
                self._daemon_seen = now
        return "no daemon" if now - self._daemon_seen >= self._grace_s else None


def wait_for_samples(
    layout: CacheLayout, ledger: Ledger, samples: int, timeout_s: float, stop: threading.Event, progress: bool
) -> None:
    """Return once ``ledger`` counts ``samples`` rows; raise :class:`CacheEmptyError` when ``Patience``
    over ``timeout_s`` runs out."""
    patience = Patience(layout, timeout_s)
    changes = LedgerChanges(ledger)
    with tqdm(total=samples, desc="waiting for cached samples", unit="sample", disable=not progress) as bar:
        while True:
            rows = ledger.usage().rows
            bar.update(min(rows, samples) - bar.n)
            if rows >= samples:
                return
            why = patience.over()
            if why is None and (changes.wait(stop) or not stop.is_set()):
                continue
            head = (f"cache {layout.root} holds {rows} samples after {patience.elapsed():.0f}s, fewer than "
                    f"loader.min_samples={samples}")
            raise CacheEmptyError(f"{head}{_advice(why)} or lower loader.min_samples")


def _advice(why: str | None) -> str:
    """The end of a wait's message, for ``Patience.over``'s reason."""
    if why == "no daemon":
        return ", and no sync daemon runs on it: start `epochcache sync` with this cache.dir,"
    return "; its sync daemon is running: raise loader.wait_timeout_s,"
