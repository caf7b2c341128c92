"""How the loaders of a torch.distributed job agree on each epoch, so no rank waits at its end.

Ranks that name the same cache directory on the same host form a *node*: they share one cache and
must read one snapshot, each a disjoint part of its order. Every rank of the job must get the same
number of batches, from the same epoch and the same resumed position; when one rank must build an
epoch prepared ahead again (a shard quarantined since), every rank does. These agreements are
collective calls on a gloo group of the loader's own, so they never interleave with the training's
collectives (which may run on NCCL, from another thread). The group waits as long as the job's
default group does (``init_process_group(timeout=...)``, torch's 30 minutes if none was given): a
rank that died or stopped calling the loader fails the others within that time, with a
:class:`LoaderError` naming the agreement, never a silent hang. Nodes whose daemons fetch one remote
must split it (distinct ``sampler.node_rank``, one ``sampler.num_nodes``): checked once, as the
loaders start, from what each node's daemon recorded in its ledger.

Without an initialised process group, :class:`Peers` is the one-process case: no collective at all.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from epochcache.cache.ledger import Ledger
from epochcache.errors import LoaderError
from epochcache.sync.identity import recorded_splits

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peers:
    """This process's place: ``rank``/``world`` in the job, ``local_rank``/``local_world`` in its node.

    ``group`` is the loader's gloo group (None when not distributed); ``node_ranks`` the global ranks
    reading the same cache, this one included; ``timeout`` what each agreement waits at most.
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
    timeout: timedelta = dist.default_pg_timeout

    @classmethod
    def discover(cls, cache_dir: str | os.PathLike[str], ledger: Ledger) -> Peers:
        """Collective when distributed: every rank must build its loader at the same point of its
        script. ``ledger`` is the cache's: how its daemon split the remote is checked against the
        other nodes' (a :class:`LoaderError` on every rank if two nodes would fetch the same samples)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        rank, world, timeout = dist.get_rank(), dist.get_world_size(), _job_timeout()
        joining = cls(rank, world, timeout=timeout)
        group = joining._agree("forming the loader's gloo group", lambda: dist.new_group(backend="gloo",
                                                                                         timeout=timeout))
        keys: list[Any] = [None] * world
        mine = (socket.gethostname(), os.path.realpath(cache_dir), uuid.uuid4().hex, recorded_splits(ledger))
        joining._agree("finding the ranks that share a cache",
                       lambda: dist.all_gather_object(keys, mine, group=group))
        node = tuple(r for r, key in enumerate(keys) if key[:2] == keys[rank][:2])
        for warning in check_node_splits({key[:2]: key[3] for key in keys}):
            if rank == 0:  # (every rank finds it: one says it)
                log.warning("%s", warning)
        return cls(rank, world, node.index(rank), len(node), node, group, keys[node[0]][2], timeout)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def common_shards(self, shard_ids: list[str]) -> list[str]:
        """The shards every rank of this node can read (each holds a lease on its own snapshot, so
        each shard of the intersection is leased by all of them), sorted: the node's one snapshot."""
        if not self.distributed:
            return sorted(shard_ids)
        every: list[Any] = [None] * self.world
        self._agree("agreeing on the node's snapshot",
                    lambda: dist.all_gather_object(every, shard_ids, group=self.group))
        common = set(shard_ids).intersection(*(every[r] for r in self.node_ranks))
        return sorted(common)

    def agreed_batches(self, epoch: int, batches: int, start: int) -> int:
        """The smallest batch count over all ranks of the job, once every rank is known to build
        ``epoch`` from batch ``start`` (a :class:`LoaderError` on every rank otherwise: a rank that
        resumed elsewhere would hand out a different number of batches, and DDP would hang)."""
        if not self.distributed:
            return batches
        mine = torch.tensor([epoch, batches, start], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        self._agree(f"agreeing on epoch {epoch}'s batch count",
                    lambda: dist.all_gather(every, mine, group=self.group))
        places = {(int(t[0]), int(t[2])) for t in every}
        if len(places) > 1:
            where = ", ".join(f"rank {r}: epoch {int(t[0])} from batch {int(t[2])}" for r, t in enumerate(every))
            raise LoaderError(
                f"the ranks build different epochs or resume at different batches ({where}): every rank must "
                "call load_state_dict with the state_dict its own loader saved at the same step, and "
                "iterate (or leave) each epoch at the same batch"
            )
        return min(int(t[1]) for t in every)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the job (an all-reduce MAX): whether every rank must
        build its next epoch again, because one must."""
        if not self.distributed:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64)
        self._agree("agreeing whether an epoch prepared ahead is built again",
                    lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group))
        return bool(value.item())

    def _agree(self, what: str, collective: Callable[[], T]) -> T:
        """``collective``'s result; a :class:`LoaderError` saying ``what`` failed if a rank never joined."""
        try:
            return collective()
        except RuntimeError as exc:  # gloo's errors (a peer gone, the timeout) are RuntimeErrors
            raise LoaderError(
                f"rank {self.rank} of {self.world}: {what} failed: a rank exited, hung, or stopped calling "
                f"its loader (look at the other ranks' logs; this wait is bounded by init_process_group's "
                f"timeout, {self.timeout.total_seconds():g}s here): {exc}"
            ) from exc


def check_node_splits(splits: dict[tuple[str, str], list[tuple[str, int, int, int]]]) -> list[str]:
    """``splits``: per node (host, cache dir), how its daemon split each remote (url, seed, node_rank,
    num_nodes). A :class:`LoaderError` if nodes fetching the same url would fetch a sample twice:
    the same node_rank, different num_nodes, or a different seed (another order of the objects).
    Returns warnings: for each url that every node has recorded a split of, the shares (node ranks
    below num_nodes) that no node of the job holds, and so no node fetches (unless another job does)."""
    by_url: dict[str, list[tuple[str, int, int, int]]] = {}
    for (host, cache), node_splits in sorted(splits.items()):
        for url, seed, node_rank, nodes in node_splits:
            by_url.setdefault(url, []).append((f"{host}:{cache}", seed, node_rank, nodes))
    warnings = []
    for url, sharing in by_url.items():
        ranks = [r for _, _, r, _ in sharing]
        if len(set(ranks)) < len(ranks) or len({(s, n) for _, s, _, n in sharing}) > 1:
            shown = "; ".join(f"{name} has sampler.node_rank={r}, num_nodes={n}, seed={s}" for name, s, r, n in sharing)
            raise LoaderError(
                f"the nodes' daemons do not split {url} (each sample would be fetched by more than one "
                f"node): {shown}; give each node's `epochcache sync` its own sampler.node_rank "
                "(0..num_nodes-1) and all of them the same sampler.num_nodes and sampler.seed"
            )
        nodes = sharing[0][3]
        missing = sorted(set(range(nodes)) - set(ranks))
        if missing and len(sharing) == len(splits):
            warnings.append(
                f"the daemons of this job's {len(splits)} node(s) split {url} into sampler.num_nodes={nodes} "
                f"shares and fetch share(s) {', '.join(map(str, sorted(ranks)))}: share(s) "
                f"{', '.join(map(str, missing))} ({len(missing)}/{nodes} of the remote) are fetched by no node "
                "of this job; set sampler.num_nodes to the number of nodes, unless another job trains on them"
            )
    return warnings


def _job_timeout() -> timedelta:
    """What the job's default group waits for a collective: ``init_process_group``'s timeout."""
    default = dist.distributed_c10d._get_default_group()
    for device in default._device_types:
        # the backend's options are where torch keeps it (no public accessor as of torch 2.13)
        timeout = getattr(getattr(default._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return dist.default_pg_timeout
