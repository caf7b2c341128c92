"""Quarantine: a shard that fails its checksum or Arrow structure leaves the cache's shard set.

Flow: ``quarantine_shard(layout, ledger, record, reason)`` -> the file moves from ``shards/`` to
``quarantine/`` (one rename, atomic) -> its record moves to the ledger's quarantine, counted. Used by
``epochcache verify --fix``, by the daemon's reconcile and by the loader (its background verifier,
and :class:`QuarantineUnreadable` when an epoch finds a shard it cannot read), which skips the shard
and goes on with its epoch.

Invariants: a quarantined file stays inside the budget (the ledger keeps charging its bytes until
the publisher purges it to make room, or ``epochcache gc`` does); a file is never left in the
quarantine folder without a ledger entry that charges it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from epochcache.cache.layout import CacheLayout, parse_shard_name
from epochcache.cache.ledger import Ledger, ShardRecord

log = logging.getLogger(__name__)


def quarantine_shard(layout: CacheLayout, ledger: Ledger, record: ShardRecord, reason: str) -> bool:
    """Move ``record``'s file to the quarantine and its record with it; False if it was gone already.

    Safe against a daemon that evicts the same shard meanwhile: the file moves first, then the
    record, and a record already evicted means the quarantined file is deleted at once. Safe against
    a second quarantiner (an epoch and the background verifier finding the same shard): the one that
    finds the file already moved leaves the record to the one that moved it.
    """
    target = layout.quarantine / record.filename
    try:
        (layout.shards / record.filename).replace(target)
    except FileNotFoundError:
        if target.exists():
            return False  # another quarantiner moved it; it moves the record too
        ledger.drop([record.id])  # evicted meanwhile, or the file vanished: nothing to keep
        log.warning("shard %s has no file (%s); its record is dropped", record.id, reason)
        return False
    if ledger.quarantine.add(record.id, reason) is None:
        target.unlink(missing_ok=True)  # evicted between the rename and now: its bytes are no longer charged
        return False
    log.warning("quarantined shard %s (%s): %s", record.id, layout.quarantine / record.filename, reason)
    return True


def purge_quarantine(layout: CacheLayout, ledger: Ledger) -> list[ShardRecord]:
    """Delete every quarantined file, then stop charging it (so no byte on disk goes uncharged)."""
    purged = [entry.record for entry in ledger.quarantine.entries()]
    for record in purged:
        (layout.quarantine / record.filename).unlink(missing_ok=True)
    ledger.quarantine.forget([r.id for r in purged])
    return purged


class QuarantineUnreadable:
    """``(path, error)`` -> the shard at ``path`` quarantined with the error as reason.

    Picklable (it carries only the cache root), so DataLoader workers that find a shard they cannot
    read quarantine it from their own process; the ledger is opened only then, which is rare.
    """

    def __init__(self, root: Path):
        self._root = root

    def __call__(self, path: str, error: Exception) -> None:
        name = parse_shard_name(Path(path).name)
        if name is None:
            return  # not a shard file of this cache: nothing the ledger knows
        layout = CacheLayout(self._root)
        ledger = Ledger(layout.ledger)
        try:
            found = ledger.shard(name[0])  # one lookup: a worker may meet this in a cache of 100,000 shards
            if found is not None and found.filename == Path(path).name:
                quarantine_shard(layout, ledger, found, f"unreadable when an epoch read it: {error}")
        finally:
            ledger.close()
