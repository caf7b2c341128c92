"""``epochcache verify`` and ``epochcache gc``: checks and clean-ups a person runs on a cache dir.

Flow: Config -> open the layout and ledger -> :func:`epochcache.cache.repair.check` / ``reconcile`` or the
quarantine purge -> counts. Anything that deletes files other than quarantined ones takes the cache
dir's lock, so it never races a running sync daemon (which holds it). A ``cache.dir`` that holds no
cache is refused, never created (a mistyped path would otherwise pass as a cache with nothing wrong).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.lockfile import exclusive, holder
from epochcache.cache.quarantine import purge_quarantine
from epochcache.cache.repair import Repairs, check, reconcile
from epochcache.config import Config
from epochcache.errors import LedgerError, LedgerFullError
from epochcache.tools.clear import existing_layout

log = logging.getLogger(__name__)


def verify_cache(config: Config, fix: bool = False, progress: bool | None = False) -> tuple[Repairs, bool]:
    """Check every shard's file and checksum against the ledger; with ``fix`` repair (needs the lock).

    With ``fix``, an unreadable ledger is first rebuilt from the shard files (each carries its record).
    Both read every byte of the cache: ``progress`` shows bars (:mod:`epochcache.cache.progress`).
    Returns what was found and whether a daemon was running. Raises :class:`DaemonRunningError` if
    ``fix`` is asked while a daemon runs, :class:`CacheError` if ``cache.dir`` holds no cache or an
    unreadable ledger must be rebuilt while another process has it open.
    """
    if fix:
        layout = CacheLayout.create(existing_layout(config, ledger_lost=True).root)
        with exclusive(layout.lock, "epochcache verify --fix"):
            ledger = _whole_ledger(layout, progress)
            try:
                return reconcile(layout, ledger, checksums=True, progress=progress), False
            finally:
                ledger.close()
    with _opened(config) as (layout, ledger):
        live = holder(layout.lock) is not None
        return check(layout, ledger, checksums=True, live=live, progress=progress), live


def collect_garbage(config: Config) -> dict[str, int]:
    """Delete quarantined files and expired leases; with no daemon running, also crash debris."""
    with _opened(config) as (layout, ledger):
        done = {
            "quarantined shards deleted": len(purge_quarantine(layout, ledger)),
            "expired leases purged": ledger.leases.purge_expired(),
        }
        if holder(layout.lock) is None:
            with exclusive(layout.lock, "epochcache gc"):
                repairs = reconcile(layout, ledger)
            done["debris files removed"] = repairs.temp_files + repairs.unknown_files
        return done


def _whole_ledger(layout: CacheLayout, progress: bool | None = False) -> Ledger:
    """The cache's ledger, rebuilt from the shard files if it is unreadable (hold the lock)."""
    try:
        ledger = Ledger(layout.ledger)
    except LedgerFullError:
        raise
    except LedgerError as exc:
        log.warning("%s", exc)
        return Ledger.rebuild(layout.ledger, progress=progress)
    if ledger.db.intact():
        return ledger
    ledger.close()
    log.warning("the ledger %s is damaged (PRAGMA quick_check)", layout.ledger)
    return Ledger.rebuild(layout.ledger, progress=progress)


@contextmanager
def _opened(config: Config) -> Iterator[tuple[CacheLayout, Ledger]]:
    layout = existing_layout(config)
    ledger = Ledger(layout.ledger)
    try:
        yield layout, ledger
    finally:
        ledger.close()
