"""The epoch leases a loader holds, kept alive by a heartbeat until released.

In: lease ids as the loader's snapshots take them (:meth:`HeldLeases.hold`) and lets them go
(:meth:`HeldLeases.release`). Out: each held lease renewed every third of ``ttl_s`` on a thread of
its own, so an owner on another host keeps its shards while it runs; on :meth:`HeldLeases.close`
every lease still held is released.

Invariant: a lease this loader took is either held here (renewed) or released in the ledger; a
renewal that finds a held lease ended (the process stalled past its TTL) is logged, since its shards
may then be evicted under the epoch.
"""

from __future__ import annotations

import logging
import threading

from epochcache.cache.ledger import Ledger

log = logging.getLogger(__name__)


class HeldLeases:
    """Leases of ``ledger`` held by this process, renewed for ``ttl_s`` seconds at a time."""

    def __init__(self, ledger: Ledger, ttl_s: float):
        self._ledger, self._ttl_s = ledger, ttl_s
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._renew, name="epochcache-lease", daemon=True)
        self._heartbeat.start()

    def hold(self, lease_id: str) -> None:
        with self._lock:
            self._held.add(lease_id)

    def release(self, lease_id: str) -> None:
        with self._lock:
            self._held.discard(lease_id)
        self._ledger.leases.release(lease_id)

    def close(self) -> None:
        """Stop the heartbeat and release every lease still held."""
        self._closed.set()
        self._heartbeat.join()
        with self._lock:
            for lease_id in self._held:
                self._ledger.leases.release(lease_id)
            self._held.clear()

    def _renew(self) -> None:
        while not self._closed.wait(self._ttl_s / 3):
            with self._lock:
                held = list(self._held)
            for lease_id in held:
                if not self._ledger.leases.renew(lease_id, self._ttl_s):
                    with self._lock:
                        lost = lease_id in self._held  # else it was released meanwhile: no loss
                    if lost:
                        log.warning("lease %s expired before renewal (process stalled longer than "
                                    "loader.lease_ttl_s?): its shards may be evicted", lease_id)
