"""Eviction policies: tiny objects, chosen by name, that order shards for removal.

A policy sees only shards under no live lease (the ledger filters them) and returns victims, in
order, until their bytes reach what must be freed. The ledger applies the choice inside the same
transaction that reserves room for the next shard, so the budget and the leases are checked together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from epochcache.errors import ConfigError
from epochcache.ledger import ShardRecord, take_until


@dataclass(frozen=True)
class Fifo:
    """Oldest published shard first: the local set rotates steadily through the remote."""

    name: ClassVar[str] = "fifo"

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        return take_until(sorted(candidates, key=lambda r: (r.created, r.id)), need)


POLICIES = {policy.name: policy for policy in (Fifo(),)}


def policy_named(name: str) -> Fifo:
    """The policy registered under ``name``; raises :class:`ConfigError` naming the valid ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"cache.eviction = {name!r}: unknown policy; choose one of {sorted(POLICIES)}") from None

