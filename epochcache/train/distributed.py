"""How the loaders of a torch.distributed job agree on each epoch, so no rank waits at its end.

Ranks that name the same cache directory on the same host form a *node*: they share one cache and
must read one snapshot, each a disjoint part of its order. Every rank of the job must get the same
number of batches. Both agreements are collective calls on a gloo group of the loader's own, so they
never interleave with the training's collectives (which may run on NCCL, from another thread).

Without an initialised process group, :class:`Peers` is the one-process case: no collective at all.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Peers:
    """This process's place: ``rank``/``world`` in the job, ``local_rank``/``local_world`` in its node.

    ``group`` is the loader's gloo group (None when not distributed); ``node_ranks`` the global ranks
    reading the same cache, this one included.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    node_ranks: tuple[int, ...] = (0,)
    group: Any = None
    # What this node's ranks call their run (the node's first rank's random name): each epoch's
    # snapshots, one per rank, name it so the ledger counts one use of each shard per epoch.
    node_key: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def discover(cls, cache_dir: str | os.PathLike[str]) -> Peers:
        """Collective when distributed: every rank must build its loader at the same point of its script."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        group = dist.new_group(backend="gloo")
        keys: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(keys, (socket.gethostname(), os.path.realpath(cache_dir), uuid.uuid4().hex),
                               group=group)
        rank = dist.get_rank()
        node = tuple(r for r, key in enumerate(keys) if key[:2] == keys[rank][:2])
        return cls(rank, len(keys), node.index(rank), len(node), node, group, keys[node[0]][2])

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def common_shards(self, shard_ids: list[str]) -> list[str]:
        """The shards every rank of this node can read (each holds a lease on its own snapshot, so
        each shard of the intersection is leased by all of them), sorted: the node's one snapshot."""
        if not self.distributed:
            return sorted(shard_ids)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, shard_ids, group=self.group)
        common = set(shard_ids).intersection(*(every[r] for r in self.node_ranks))
        return sorted(common)

    def fewest_batches(self, batches: int) -> int:
        """The smallest batch count over all ranks of the job (an all-reduce MIN)."""
        if not self.distributed:
            return batches
        count = torch.tensor([batches], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.group)
        return int(count.item())
