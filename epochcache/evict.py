"""Eviction policies: tiny objects, chosen by name, that order shards for removal.

A policy sees every shard not already retiring, leased or not, and returns victims in its order
until their bytes reach what must be freed. The ledger applies the choice inside the transaction that
reserves room for the next shard: unleased victims are evicted at once, leased ones retire (left out
of new snapshots) and go when their leases end. Leases never bend a policy's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from epochcache.errors import ConfigError
from epochcache.ledger import ShardRecord, by_age, take_until


@dataclass(frozen=True)
class Fifo:
    """Oldest published shard first: the local set rotates steadily through the remote."""

    name: ClassVar[str] = "fifo"

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        return take_until(sorted(candidates, key=by_age), need)


POLICIES = {policy.name: policy for policy in (Fifo(),)}


def policy_named(name: str) -> Fifo:
    """The policy registered under ``name``; raises :class:`ConfigError` naming the valid ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"cache.eviction = {name!r}: unknown policy; choose one of {sorted(POLICIES)}") from None

