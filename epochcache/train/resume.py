"""The loader's resume state: where an epoch stands, as a plain dict a checkpoint can hold.

Out (``Progress.state``): ``{"epoch", "position", "seed", "shards", "snapshot"}``: the epoch, the
batches of it already handed out, the shuffle seed, the epoch's exact shard ids and their hash (the
snapshot's identity). In (``read_state``): that dict, checked, back as a :class:`Progress`. Because an
epoch's order is a pure function of (shard set, seed, epoch), this is all a resumed loader needs to
skip exactly the batches already seen.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from epochcache.errors import LoaderError

STATE_KEYS = ("epoch", "position", "seed", "shards", "snapshot")


def snapshot_id(shard_ids: tuple[str, ...] | list[str]) -> str:
    """The identity of a shard set: a hash of its sorted shard ids."""
    return hashlib.sha256("\n".join(sorted(shard_ids)).encode()).hexdigest()[:16]


@dataclass
class Progress:
    """Where the running (or resumable) epoch stands; ``shards`` empty: a fresh snapshot is due."""

    epoch: int
    position: int
    batches: int | None  # None: a loaded state whose epoch has not been rebuilt yet
    shards: tuple[str, ...]

    @property
    def unfinished(self) -> bool:
        return self.batches is None or self.position < self.batches

    @cached_property
    def snapshot(self) -> str:
        """The shard set's identity, hashed once (a trainer may call ``state_dict()`` every step: at
        200,000 shards a hash costs 15 ms)."""
        return snapshot_id(self.shards)

    def state(self, seed: int) -> dict[str, Any]:
        if not self.shards:
            return {"epoch": self.epoch, "position": 0, "seed": seed, "shards": None, "snapshot": None}
        return {
            "epoch": self.epoch, "position": self.position, "seed": seed,
            "shards": list(self.shards), "snapshot": self.snapshot,
        }


def read_state(state: dict[str, Any]) -> tuple[Progress, int]:
    """``state`` (from :meth:`Progress.state`) as the progress to resume and its seed; raises
    :class:`LoaderError` if keys are missing or the shard ids do not match their hash."""
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise LoaderError(f"load_state_dict: state lacks {missing}; pass a dict made by EpochCachedLoader.state_dict()")
    shards = tuple(state["shards"] or ())
    if state["snapshot"] is not None and snapshot_id(shards) != state["snapshot"]:
        raise LoaderError(
            f"load_state_dict: snapshot {state['snapshot']!r} does not match its {len(shards)} shard ids: "
            "the state was altered; pass it as state_dict() returned it"
        )
    return Progress(int(state["epoch"]), int(state["position"]) if shards else 0, None, shards), int(state["seed"])
