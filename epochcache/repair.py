"""Reconciliation of a cache directory's files against its ledger, run at every daemon start.

The ledger is the truth; files disagreeing with it are the debris of a crash: temp files of a shard
that was being written, files whose record was removed just before they were deleted, and records
whose file is gone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from epochcache.layout import SHARD_SUFFIX, TMP_SUFFIX, CacheLayout
from epochcache.ledger import Ledger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Repairs:
    """What ``reconcile`` changed: removed temp files, removed unknown shard files, dropped records."""

    temp_files: int
    unknown_files: int
    missing_records: int


def reconcile(layout: CacheLayout, ledger: Ledger) -> Repairs:
    """Make disk and ledger agree; only the one daemon of a cache dir may call this (it holds the lock)."""
    known = {record.filename: record.id for record in ledger.shards()}
    temp = unknown = 0
    for path in layout.shards.iterdir():
        if path.name.endswith(TMP_SUFFIX):
            path.unlink()
            temp += 1
        elif path.name.endswith(SHARD_SUFFIX) and path.name not in known:
            path.unlink()
            unknown += 1
    missing = [sid for name, sid in known.items() if not (layout.shards / name).exists()]
    ledger.drop(missing)
    ledger.clear_reservation()
    ledger.clear_retiring()
    repairs = Repairs(temp_files=temp, unknown_files=unknown, missing_records=len(missing))
    if temp or unknown or missing:
        log.warning("reconciled %s: %s", layout.root, repairs)
    return repairs
