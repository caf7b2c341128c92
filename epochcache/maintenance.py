"""``epochcache verify`` and ``epochcache gc``: checks and clean-ups a person runs on a cache dir.

Flow: Config -> open the layout and ledger -> :func:`epochcache.repair.check` / ``reconcile`` or the
quarantine purge -> counts. Anything that deletes files other than quarantined ones takes the cache
dir's lock, so it never races a running sync daemon (which holds it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from epochcache.config import Config
from epochcache.layout import CacheLayout
from epochcache.ledger import Ledger
from epochcache.lockfile import exclusive, holder
from epochcache.quarantine import purge_quarantine
from epochcache.repair import Repairs, check, reconcile


def verify_cache(config: Config, fix: bool = False) -> tuple[Repairs, bool]:
    """Check every shard's file and checksum against the ledger; with ``fix`` repair (needs the lock).

    Returns what was found and whether a daemon was running. Raises :class:`DaemonRunningError` if
    ``fix`` is asked while a daemon runs.
    """
    with _opened(config) as (layout, ledger):
        if fix:
            with exclusive(layout.lock, "epochcache verify --fix"):
                return reconcile(layout, ledger, checksums=True), False
        live = holder(layout.lock) is not None
        return check(layout, ledger, checksums=True, live=live), live


def collect_garbage(config: Config) -> dict[str, int]:
    """Delete quarantined files and expired leases; with no daemon running, also crash debris."""
    with _opened(config) as (layout, ledger):
        done = {
            "quarantined shards deleted": len(purge_quarantine(layout, ledger)),
            "expired leases purged": ledger.purge_expired(),
        }
        if holder(layout.lock) is None:
            with exclusive(layout.lock, "epochcache gc"):
                repairs = reconcile(layout, ledger)
            done["debris files removed"] = repairs.temp_files + repairs.unknown_files
        return done


@contextmanager
def _opened(config: Config) -> Iterator[tuple[CacheLayout, Ledger]]:
    layout = CacheLayout.create(config.cache.dir)
    ledger = Ledger(layout.ledger)
    try:
        yield layout, ledger
    finally:
        ledger.close()
