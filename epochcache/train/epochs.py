"""Building one epoch: its snapshot and lease, the shards it reads, its dataset, order and batches.

In: the epoch's number, whether it is prepared ahead, a resume position, the loader's settings at
that time, and a factory of batch sources (the loader's: a batch thread or its worker pool). Out: a
:class:`PreparedEpoch`, whose :class:`EpochInfo` says what it was built from, holding its lease and
its batch source, not yet handed out.

Invariants: the lease is held (renewed, :class:`epochcache.train.leases.HeldLeases`) from the
snapshot on, and released if the build fails; the shards read are those of the lease whose file is
there at its recorded size (others quarantined), agreed by every rank of the node, of one schema;
:meth:`EpochBuilder.quarantined_since` tells whether the ledger may have quarantined one of them
since, so a prepared epoch is rebuilt rather than read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Lease, Ledger, ShardRecord
from epochcache.cache.quarantine import QuarantineUnreadable, quarantine_shard
from epochcache.cache.shards import open_shard
from epochcache.config import LoaderConfig
from epochcache.errors import CacheEmptyError, LoaderError, ShardCorruptError
from epochcache.sources.base import KEY_COLUMN
from epochcache.train.commits import CommitMarks
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.distributed import Peers
from epochcache.train.leases import HeldLeases
from epochcache.train.mappings import ShardMaps
from epochcache.train.order import EpochBatches, batch_count, epoch_order, rank_part
from epochcache.train.prefetch import BatchThread
from epochcache.train.resume import Progress, snapshot_id
from epochcache.train.timing import PrepareClock
from epochcache.train.waiting import LedgerChanges, Patience
from epochcache.train.workers import PoolEpoch

BatchSource = BatchThread | PoolEpoch
# (dataset, sampler) -> the epoch's batch source; None for an epoch of no batches
SourceFactory = Callable[[ShardSetDataset, EpochBatches], BatchSource | None]


@dataclass(frozen=True)
class EpochInfo:
    """What an epoch was built from. ``snapshot`` identifies its shard set (a hash of the shard ids);
    ``start_batch`` > 0 for a resumed epoch; ``first_batch_wait_s`` is the time from ``iter()`` to its
    first batch, None until that batch exists. ``coverage`` and ``echo``: the cache's, this epoch
    included (see :mod:`epochcache.cache.coverage`; coverage None while the remote's size is unknown)."""

    epoch: int
    shards: int
    samples: int
    bytes: int
    batches: int
    skipped_shards: int
    prepared_ahead: bool = False
    first_batch_wait_s: float | None = None
    snapshot: str = ""
    start_batch: int = 0
    coverage: float | None = None
    echo: float | None = None


class PreparedEpoch:
    """A built epoch: its lease, shard ids and batch source; ``start`` begins producing batches.

    Without workers the preparing thread starts the batch thread itself, which builds the first
    batches at once. With workers, ``start`` queues the epoch on the loader's worker pool (from the
    main thread, at a batch boundary once the preparation is done), behind the epoch being read, so
    the workers go on to it as soon as they are free (:mod:`epochcache.train.workers`).
    """

    def __init__(
        self, info: EpochInfo, lease: Lease, shards: tuple[str, ...], source: BatchSource | None,
        unverified: tuple[ShardRecord, ...] = (), quarantines: int = 0, version: int | None = None,
        mark: bytes | None = None,
    ):
        self.info, self.lease, self.shards, self._source = info, lease, shards, source
        self.unverified = unverified  # the epoch's shards not yet checksummed on this host
        self.quarantines = quarantines  # the ledger's count of quarantined shards before its snapshot
        # the ledger's version (ledger.db.version(): it changes with other connections' commits, quarantines
        # among them) once built, if that count was still the same
        self.version = version
        # its info once its first batch is out, made here, off the epoch boundary (see first_batch_out)
        self._first = replace(info, first_batch_wait_s=0.0)
        # the ledger's commit mark (epochcache.train.commits) read before a check found no quarantine
        # since the snapshot: while it is unchanged, none can have happened (moved on by EpochBuilder.recheck)
        self.mark = mark

    def first_batch_out(self, wait_s: float) -> EpochInfo:
        """Its info with ``first_batch_wait_s``, as its first batch is handed out. (Made ahead: at an epoch
        boundary, with caches cold after the gathers, ``dataclasses.replace`` took 25-40 µs; the field is
        set before the info is published to anyone.)"""
        object.__setattr__(self._first, "first_batch_wait_s", wait_s)
        return self._first

    @property
    def usable(self) -> bool:
        """False once its worker pool was closed (by an epoch left early): it must be built again."""
        return not (isinstance(self._source, PoolEpoch) and self._source.pool.closed)

    def start(self) -> None:
        if isinstance(self._source, PoolEpoch):
            self._source.start()

    def batches(self) -> Generator[Any, None, None]:
        if isinstance(self._source, PoolEpoch):
            yield from self._source.batches()  # (pinned as the pool receives them)
        elif self._source is not None:
            yield from self._source

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
        self._source = None


class EpochBuilder:
    """Builds the epochs of one loader (see the module docstring): ``layout`` and ``ledger`` are its
    cache's, ``peers`` the ranks that share it, ``leases`` where its leases are held, ``maps`` the
    shard mappings reused from epoch to epoch, ``owner`` its name on leases, ``closed`` set when the
    loader closes (a wait for shards ends), ``clock`` told each build's time, ``commits`` the
    ledger's commit marks (:mod:`epochcache.train.commits`)."""

    def __init__(
        self, layout: CacheLayout, ledger: Ledger, peers: Peers, leases: HeldLeases, maps: ShardMaps[Any],
        owner: str, closed: threading.Event, clock: PrepareClock, commits: CommitMarks,
    ):
        self._layout, self._ledger, self._peers, self._leases, self._maps = layout, ledger, peers, leases, maps
        self._owner, self._closed, self._clock, self._commits = owner, closed, clock, commits
        self._present_ids: set[str] = set()  # shards of the last lease whose file this loader found at its size

    def build(
        self, epoch: int, ahead: bool, resume: Progress | None, config: LoaderConfig, sources: SourceFactory,
    ) -> PreparedEpoch:
        """Epoch ``epoch`` under ``config``, its batches from ``sources``; ``resume``: skip the batches
        it had handed out. The lease is released if anything fails."""
        quarantines = self._quarantines()
        lease, started = self._snapshot(epoch, config)
        try:
            records = self._agreed_records(lease, resume)
            self._check_one_schema(records)
            dataset = ShardSetDataset(
                [self._layout.shard_file(r.filename) for r in records], [r.rows for r in records], config.columns,
                self._maps, QuarantineUnreadable(self._layout.root),
            )
            sampler = self._sampler(config, [r.rows for r in records], epoch, resume.position if resume else 0)
            info = EpochInfo(
                epoch=epoch, shards=len(records), samples=len(dataset), bytes=sum(r.nbytes for r in records),
                batches=sampler.count, skipped_shards=len(lease.shards) - len(records), prepared_ahead=ahead,
                snapshot=snapshot_id([r.id for r in records]), start_batch=min(sampler.start, sampler.count),
            )
            source = sources(dataset, sampler)
            unverified = tuple(r for r in records if not r.verified)
            mark = self._commits.now()  # read before the version: a commit after it changes the mark
            version = self._version_unless_quarantined(quarantines)
            self._clock.prepare_s = time.monotonic() - started
            return PreparedEpoch(info, lease, tuple(r.id for r in records), source, unverified, quarantines, version,
                                 mark if version is not None else None)
        except BaseException:
            self._leases.release(lease.id)
            raise

    def _quarantines(self) -> int:
        return self._ledger.counters.all().get("quarantined", 0)

    def _version_unless_quarantined(self, quarantines: int) -> int | None:
        """The ledger's version now, if no shard was quarantined since ``quarantines`` were counted
        (counted again after reading it: a quarantine in between changes the version); else None."""
        # every quarantine is another connection's commit (the verifier's, a worker's, the daemon's)
        version = self._ledger.db.version()
        return version if self._quarantines() == quarantines else None

    def quarantined_since(self, prepared: PreparedEpoch) -> bool:
        """Whether a shard may have been quarantined since ``prepared``'s snapshot: not if no connection
        committed to the ledger since its mark (a memory read), nor if no other one committed since it
        was built (one statement), else by counting again."""
        if prepared.mark is not None and self._commits.now() == prepared.mark:
            return False
        if prepared.version is not None and self._ledger.db.version() == prepared.version:
            return False
        return self._quarantines() != prepared.quarantines

    def recheck(self, prepared: PreparedEpoch) -> None:
        """Off the epoch boundary, after this loader's own commits (a lease released, an epoch recorded):
        if no shard was quarantined since ``prepared``'s snapshot, move its mark past those commits, so
        that at its start the mark alone decides."""
        mark = self._commits.now()  # read before the check: a commit after it changes the mark
        if mark is not None and not self.quarantined_since(prepared):
            prepared.mark = mark

    def _snapshot(self, epoch: int, config: LoaderConfig) -> tuple[Lease, float]:
        """A lease on a shard set holding at least one row, waiting for it while a daemon runs (up to
        ``wait_timeout_s``; see :class:`epochcache.train.waiting.Patience`), and when the snapshot that
        gave it began (``time.monotonic()``: what came before was waiting, not preparing)."""
        patience = Patience(self._layout, config.wait_timeout_s)
        changes = LedgerChanges(self._ledger)  # an empty snapshot is taken again once the daemon published
        while True:
            attempt = time.monotonic()
            lease = self._ledger.leases.snapshot(f"{self._owner}:epoch{epoch}", config.lease_ttl_s,
                                                 use=f"{self._peers.node_key}:epoch{epoch}")
            self._leases.hold(lease.id)
            if any(r.rows for r in lease.shards):  # zero-row shards alone would make an epoch of no batches
                return lease, attempt
            self._leases.release(lease.id)
            why = patience.over()
            # a change: the daemon published (or wrote its state); closed: the wait ends here
            if why is not None or (not changes.wait(self._closed) and self._closed.is_set()):
                if why == "no daemon":
                    raise CacheEmptyError(
                        f"no shard in {self._layout.root} after {patience.elapsed():.0f}s and no sync daemon runs "
                        "on it: start `epochcache sync` with this cache.dir"
                    )
                raise CacheEmptyError(
                    f"no shard appeared in {self._layout.root} within {config.wait_timeout_s:g}s while "
                    "`epochcache sync` runs on it (loader.wait_timeout_s sets the wait): check `epochcache status`"
                )

    def _present(self, record: ShardRecord) -> bool:
        """Whether a shard's file is there at its recorded size (one stat, the first time this loader
        uses it); if not, it is quarantined. Its checksum is the background verifier's business."""
        if record.id in self._present_ids:
            return True
        path = self._layout.shard_file(record.filename)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError as exc:
            quarantine_shard(self._layout, self._ledger, record, f"skipped by an epoch: {exc}")
            return False
        if size != record.nbytes:
            reason = f"skipped by an epoch: {path} holds {size} bytes, the ledger recorded {record.nbytes} (truncated?)"
            quarantine_shard(self._layout, self._ledger, record, reason)
            return False
        self._present_ids.add(record.id)
        return True

    def _agreed_records(self, lease: Lease, resume: Progress | None) -> list[ShardRecord]:
        """The epoch's shards, sorted by id: the node's agreed set, or the resumed epoch's exact set."""
        usable = {r.id: r for r in lease.shards if self._present(r)}
        # A shard the lease lacks is evicted or retiring, never in a later snapshot (a daemon restart
        # may return a retiring one: stat'ed again then): forgotten, so the set is the cache's size,
        # not that of every shard published over the loader's life.
        self._present_ids.intersection_update(usable)
        common = self._peers.common_shards(list(usable))
        if resume is None:
            return [usable[i] for i in common]
        gone = sorted(set(resume.shards) - set(common))
        if gone:
            raise LoaderError(
                f"cannot resume epoch {resume.epoch} at batch {resume.position}: {len(gone)} of its "
                f"{len(resume.shards)} shards are no longer in {self._layout.root} (evicted or corrupt, e.g. "
                f"{gone[0]}); resume from the next epoch instead: load_state_dict({{**state, 'epoch': "
                f"{resume.epoch + 1}, 'position': 0, 'shards': None, 'snapshot': None}})"
            )
        return [usable[i] for i in sorted(resume.shards)]

    def _check_one_schema(self, records: list[ShardRecord]) -> None:
        """A :class:`LoaderError` if the records name two schema fingerprints (the ledger's, so this
        reads no shard unless there is a conflict to describe); shards of unknown schema ("") are
        checked by the dataset as it opens them."""
        first: dict[str, ShardRecord] = {}
        for record in records:
            if record.schema:
                first.setdefault(record.schema, record)
        if len(first) > 1:
            counts = {fp: sum(r.schema == fp for r in records) for fp in first}
            (a, one), (b, two) = list(first.items())[:2]
            raise LoaderError(
                f"the cache {self._layout.root} holds shards of {len(first)} schemas: {counts[a]} shards with "
                f"{_schema_of(self._layout, one)}, {counts[b]} with {_schema_of(self._layout, two)} (it was filled "
                "under different source columns or sources); empty it with `epochcache clear`, or give "
                "cache.dir a new directory"
            )

    def _sampler(self, config: LoaderConfig, shard_rows: list[int], epoch: int, start: int) -> EpochBatches:
        cfg, peers = config, self._peers
        # Half the open maps per window: a batch near a window's end also touches the next window.
        window = max(1, cfg.max_open_shards // 2)
        order = epoch_order(sum(shard_rows), cfg.seed, epoch, cfg.shuffle, cfg.epoch_samples, cfg.replacement,
                            shard_rows, window)
        part = rank_part(order, peers.local_rank, peers.local_world)
        count = peers.agreed_batches(epoch, batch_count(len(part), cfg.batch_size, cfg.drop_last), start)
        return EpochBatches(part, cfg.batch_size, count, start)


def _schema_of(layout: CacheLayout, record: ShardRecord) -> str:
    """A shard's columns as ``[name: type, ...]``, for a message."""
    try:
        schema = open_shard(layout.shards / record.filename).schema
    except (ShardCorruptError, OSError) as exc:
        return f"schema {record.schema} (shard {record.filename} unreadable: {exc})"
    return "[" + ", ".join(f"{f.name}: {f.type}" for f in schema if f.name != KEY_COLUMN) + "]"
