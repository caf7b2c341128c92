"""Coverage and echo of a cache's epochs: how much of the remote training has seen, and how many
times over.

In: the ledger's epoch records (``ledger.leases.epochs()``: samples trained and distinct samples trained,
kept by every snapshot, with the daemon's estimate of the remote's rows then: ``remote_rows`` in the
progress published with its cursor). Out: :class:`Coverage`, for ``epochcache status`` and
``EpochCachedLoader.last_epoch``. ``coverage`` = distinct samples trained / samples in this node's
share of the remote; ``echo`` = samples trained / distinct samples trained (1.0: no sample seen
twice). Distinct samples are exact at unit level; a unit's rows are counted as its shard's rows per
unit, and the remote's rows are an estimate until every footer was read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epochcache.cache.ledger import Ledger


@dataclass(frozen=True)
class Coverage:
    epochs: int
    trained: int
    distinct: float
    remote: int | None  # estimated samples of the remote (this node's share); None while unknown
    fetched_bytes: int

    @property
    def coverage(self) -> float | None:
        return None if not self.remote else min(1.0, self.distinct / self.remote)

    @property
    def echo(self) -> float | None:
        return None if not self.distinct else self.trained / self.distinct

    def to_dict(self) -> dict[str, float | int | None]:
        return {"epochs": self.epochs, "samples_trained": self.trained, "distinct_trained": round(self.distinct),
                "remote_samples": self.remote, "fetched_bytes": self.fetched_bytes,
                "coverage": self.coverage, "echo": self.echo}


def coverage_of(ledger: Ledger) -> Coverage | None:
    """The cache's coverage after its latest epoch; None before its first."""
    last = ledger.leases.epochs(1)
    if not last:
        return None
    return of_epoch(last[0])


def of_epoch(epoch: dict[str, Any]) -> Coverage:
    """The coverage an epoch record (``ledger.leases.epochs()``) states."""
    return Coverage(epochs=epoch["n"], trained=epoch["trained"], distinct=epoch["distinct_trained"],
                    remote=epoch["remote_rows"], fetched_bytes=epoch["fetched_bytes"])
