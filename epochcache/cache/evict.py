"""Eviction policies: tiny objects, chosen by name, that order shards for removal.

A policy sees every shard not already retiring, leased or not, and returns victims in its order
until their bytes reach what must be freed. The ledger applies the choice inside the transaction that
reserves room for the next shard: unleased victims are evicted at once, leased ones retire (left out
of new snapshots) and go when their leases end. Leases never bend a policy's order.

Policies: ``fifo`` (oldest first, the default), ``lru`` (least recently used by an epoch first;
never-used shards count as used at their creation), ``most-used`` (the shards trained on most often
first, so the local set stays fresh), ``random`` (uniform). :class:`MaxUses` wraps any of them:
shards used ``max_uses`` times or more go first, oldest first, then the wrapped policy's picks.
:class:`MinUses` (``cache.min_uses``) wraps the result: a shard fewer epochs have used never goes.
Every policy labels its victims, so the ledger counts evictions per policy.

Each policy also gives its order as :class:`Stage` values (``stages()``: an order and bounds on
uses), which the ledger walks by index for k victims in O(k log n) instead of loading every record
(:mod:`epochcache.cache.ledger_uses`); ``__call__`` is the same order over a list (tests, and
choosers without stages). ``random`` draws the same distribution both ways, not the same draws.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

from epochcache.cache.ledger import ShardRecord, by_age, take_until
from epochcache.cache.ledger_records import Stage
from epochcache.errors import ConfigError


class Policy(Protocol):
    """Orders ``candidates`` for eviction and returns the shortest prefix freeing ``need`` bytes."""

    @property
    def name(self) -> str: ...

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]: ...

    def label(self, victim: ShardRecord) -> str: ...


class _Named:
    """Labels every victim with the policy's name."""

    name: ClassVar[str]

    def label(self, victim: ShardRecord) -> str:
        return self.name


@dataclass(frozen=True)
class Fifo(_Named):
    """Oldest published shard first: the local set rotates steadily through the remote."""

    name: ClassVar[str] = "fifo"

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        return take_until(sorted(candidates, key=by_age), need)

    def stages(self) -> list[Stage]:
        return [Stage("age")]


@dataclass(frozen=True)
class Lru(_Named):
    """Least recently used by an epoch first; a never-used shard counts as used when it was created."""

    name: ClassVar[str] = "lru"

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        def key(r: ShardRecord) -> tuple[float, float, str]:
            return (r.created if r.last_used is None else r.last_used), *by_age(r)

        return take_until(sorted(candidates, key=key), need)

    def stages(self) -> list[Stage]:
        return [Stage("recency")]


@dataclass(frozen=True)
class MostUsed(_Named):
    """The shards trained on most often first (ties: oldest first), so the local set stays fresh."""

    name: ClassVar[str] = "most-used"

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        return take_until(sorted(candidates, key=lambda r: (-r.uses, *by_age(r))), need)

    def stages(self) -> list[Stage]:
        return [Stage("uses")]


@dataclass(frozen=True)
class Random(_Named):
    """Uniformly random victims; ``seed`` (None: fresh entropy) makes the choice reproducible."""

    name: ClassVar[str] = "random"
    seed: int | None = None

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        ordered = sorted(candidates, key=by_age)  # a fixed start, so a seed means one order
        random.Random(self.seed).shuffle(ordered)
        return take_until(ordered, need)

    def stages(self) -> list[Stage]:
        return [Stage("random", seed=self.seed)]


@dataclass(frozen=True)
class MaxUses:
    """Shards used ``max_uses`` times or more go first (oldest first), then ``policy``'s order."""

    policy: Policy
    max_uses: int

    @property
    def name(self) -> str:
        return self.policy.name

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        worn = sorted((r for r in candidates if r.uses >= self.max_uses), key=by_age)
        taken = take_until(worn, need)
        rest = [r for r in candidates if r.uses < self.max_uses]
        return taken + self.policy(rest, need - sum(r.nbytes for r in taken))

    def stages(self) -> list[Stage] | None:
        """Worn shards oldest first, then the wrapped policy's stages below ``max_uses``; None if the
        wrapped policy has none."""
        inner = getattr(self.policy, "stages", None)
        if inner is None:
            return None
        worn = Stage("age", at_least=self.max_uses)
        return [worn] + [replace(s, below=min(self.max_uses, s.below if s.below is not None else self.max_uses))
                         for s in inner()]

    def label(self, victim: ShardRecord) -> str:
        return "max_uses" if victim.uses >= self.max_uses else self.policy.label(victim)


@dataclass(frozen=True)
class MinUses:
    """Only shards used by at least ``min_uses`` epochs may go, in ``policy``'s order: a shard no epoch
    has trained on is never thrown away, so with no trainer the daemon fills the budget once and
    waits, and what it fetches is bounded by training."""

    policy: Policy
    min_uses: int

    @property
    def name(self) -> str:
        return self.policy.name

    def __call__(self, candidates: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
        return self.policy([r for r in candidates if r.uses >= self.min_uses], need)

    def stages(self) -> list[Stage] | None:
        """The wrapped policy's stages, none reaching below ``min_uses``; None if it has none."""
        inner = getattr(self.policy, "stages", None)
        if inner is None:
            return None
        return [replace(s, at_least=max(s.at_least, self.min_uses)) for s in inner()]

    def label(self, victim: ShardRecord) -> str:
        return self.policy.label(victim)


POLICIES: dict[str, Policy] = {policy.name: policy for policy in (Fifo(), Lru(), MostUsed(), Random())}


def policy_named(name: str, max_uses: int | None = None, min_uses: int = 0) -> Policy:
    """The policy registered under ``name``, wrapped in :class:`MaxUses` if ``max_uses`` is set and
    in :class:`MinUses` if ``min_uses`` > 0 (outermost: no shard used fewer times goes, worn or not).

    Raises :class:`ConfigError` naming the valid policies.
    """
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ConfigError(f"cache.eviction = {name!r}: unknown policy; choose one of {sorted(POLICIES)}") from None
    if max_uses is not None:
        policy = MaxUses(policy, max_uses)
    return MinUses(policy, min_uses) if min_uses > 0 else policy
