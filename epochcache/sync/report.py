"""What one ``SyncDaemon.run`` did and why it ended."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StopReason(str, Enum):
    STOPPED = "stopped"
    BUDGET_FULL = "budget full"
    EXHAUSTED = "remote exhausted"


@dataclass
class SyncReport:
    """What one ``SyncDaemon.run`` did, in counts (a daemon runs for days: no per-unit lists)."""

    reason: StopReason = StopReason.STOPPED
    shards_published: int = 0
    bytes_published: int = 0
    samples_published: int = 0
    evicted: int = 0
    units_fetched: int = 0
    units_published: int = 0
    units_skipped: int = 0  # skip events (a unit read later at the pass end counts here too)
    units_unread: int = 0  # units still skipped when the run ended: ``sync --once`` exits 3 if any
    rows_dropped: int = 0  # rows with a null in a fixed-width column, left out of their shard
