"""The publisher: turns the rows of one shard into a published shard file under the byte budget.

Flow: ``publish(table, units, cursor)`` -> reserve the shard's exact encoded size in the ledger,
purging quarantined files and evicting by the configured policy (or waiting while only leased
shards could make room) -> write the file (tmp, fsync, rename; its record's fields in its schema
metadata) -> publish its record with the sampler's cursor in one ledger transaction -> delete the
evicted shards' files. What it is doing (running, backpressure, disk full) is written to the ledger
for ``epochcache status``.

How much goes once room must be made (``cache.low_watermark``) trades the next epoch's size for
rotation: a trainer always holds a lease on its epoch's shards, so what a boundary evicts was left
out of the next epoch, and a cache that epochs always hold rotates that much per epoch. ``auto``
evicts down to the lowest level that keeps :data:`EPOCH_FILL` of the budget in shards beside the
shard being written and the ledger: at least the next shard's room, more where the budget has it.

Invariants: the bytes under the cache dir never exceed ``cache.max_bytes`` (the shard being written
is reserved before its first byte; the footers' share, ``CacheConfig.footer_charge``, is set apart);
a shard under a lease is never deleted; a shard that is not fully written is never published and its
reservation is released; a full disk (ENOSPC) is waited out with growing pauses, never turned into
a partial shard; so is a ledger that cannot write (:class:`LedgerFullError`): the shard's file is
removed, nothing is published.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from epochcache.cache.evict import policy_named
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import PUBLISH_GROWTH, Chooser, Ledger, ShardRecord
from epochcache.cache.quarantine import purge_quarantine
from epochcache.cache.shards import ShardMeta, encoded_size, schema_fingerprint, with_record_meta, write_shard
from epochcache.config import CacheConfig
from epochcache.errors import BudgetError, LedgerFullError

log = logging.getLogger(__name__)

_BACKPRESSURE_POLL_S = 0.25
# The share of cache.max_bytes that low_watermark auto keeps in shards when it makes room, so an epoch
# of a full cache trains on at least this much (where the budget can hold it beside a shard and the ledger).
EPOCH_FILL = 0.9
# A full disk is usually freed by someone else, on a human time scale: retry soon, then back off.
DISK_FULL_FIRST_WAIT_S = 0.5
DISK_FULL_MAX_WAIT_S = 30.0


@dataclass(frozen=True)
class Published:
    """One publish: the new shard's record and the shards evicted to make room for it."""

    record: ShardRecord
    evicted: tuple[ShardRecord, ...]


class Publisher:
    """Writes and publishes shards into one cache dir; used only by the daemon that holds its lock."""

    def __init__(
        self, layout: CacheLayout, ledger: Ledger, cache: CacheConfig, stop: threading.Event, *, evict: bool = True
    ) -> None:
        """``evict=False`` (``sync --once``): publish only while the budget has free room."""
        self.layout, self.ledger, self.stop, self.evict = layout, ledger, stop, evict
        self.budget = cache.shard_budget()  # (the footers' share is set apart)
        self.low_watermark, self.shard_bytes = cache.low_watermark, int(cache.shard_bytes)
        self.policy = policy_named(cache.eviction, cache.max_uses, cache.min_uses)
        self.min_uses = cache.min_uses
        self._state = ""  # the daemon's vitals say "starting" until the first publish says "running"

    def publish(self, table: pa.Table, units: Sequence[str], cursor: dict[str, Any] | None) -> Published | None:
        """Write ``table`` (the rows of ``units``) as one shard and publish it with ``cursor``.

        Returns None, with nothing written or reserved, when ``stop`` is set while waiting for room
        or for disk space, or when ``evict`` is off and the budget is full. Raises
        :class:`BudgetError` if the shard alone cannot fit in the budget.
        """
        meta = ShardMeta(id=f"{time.time_ns():x}-{uuid.uuid4().hex[:8]}", created=time.time(), units=tuple(units))
        table = with_record_meta(table.combine_chunks(), meta)
        nbytes = encoded_size(table)
        # A bigger shard than configured: one huge unit.
        if nbytes + PUBLISH_GROWTH > self.budget - self.ledger.disk_bytes():
            raise BudgetError(
                f"a shard of {nbytes} bytes does not fit in the {self.budget} bytes of cache.max_bytes left to "
                "shards: raise the budget or lower cache.shard_bytes (units of the remote are the smallest "
                "piece a shard can hold)"
            )
        wait = DISK_FULL_FIRST_WAIT_S
        while True:
            try:
                published = self._try(table, meta, nbytes, cursor)
            except LedgerFullError as exc:
                # Like a full disk under a shard: nothing published (the file, if written, is gone), back off.
                self._say("disk full, backing off", error=str(exc))
                log.warning("%s; nothing published; backing off", exc)
                published = False
            if published is None or isinstance(published, Published):
                return published
            if self.stop.wait(wait):
                return None
            wait = min(2 * wait, DISK_FULL_MAX_WAIT_S)

    def _try(
        self, table: pa.Table, meta: ShardMeta, nbytes: int, cursor: dict[str, Any] | None
    ) -> Published | Literal[False] | None:
        """One attempt: room, write, publish. None: stopped (or full without eviction); False: the disk
        was full (shard file or ledger), nothing published; raises :class:`LedgerFullError` from the ledger."""
        evicted = self._make_room(nbytes)
        if evicted is None:
            return None
        written = self._write(table, meta.id)
        if written is None:
            return False
        checksum, path = written
        record = ShardRecord(
            id=meta.id, filename=path.name, nbytes=nbytes, rows=table.num_rows,
            created=meta.created, checksum=checksum, units=meta.units,
            schema=schema_fingerprint(table.schema), verified=True,  # write_shard checksummed the bytes written
        )
        try:
            self.ledger.publish(record, cursor)
        except LedgerFullError:
            self.layout.remove(path.name)  # never a file without its record for longer than this
            with contextlib.suppress(LedgerFullError):  # else the next reservation replaces it at restart
                self.ledger.clear_reservation()
            raise
        self._say("running")
        log.debug("published shard %s: %d rows, %d bytes", meta.id, record.rows, nbytes)
        return Published(record, tuple(evicted))

    def _write(self, table: pa.Table, shard_id: str) -> tuple[str, Path] | None:
        """Write the reserved shard; None (reservation released, temp removed) if the disk is full."""
        try:
            checksum = write_shard(table, self.layout.tmp_path(shard_id), partial(self.layout.shard_path, shard_id))
        except OSError as exc:
            with contextlib.suppress(LedgerFullError):  # the same full disk may refuse this write too
                self.ledger.clear_reservation()
            if exc.errno != errno.ENOSPC:
                raise
            self._say("disk full, backing off", error=str(exc))
            log.warning("disk full while writing a shard (%s): nothing published; backing off", exc)
            return None
        except BaseException:
            self.ledger.clear_reservation()
            raise
        return checksum, self.layout.shard_path(shard_id, checksum)

    def _make_room(self, nbytes: int) -> list[ShardRecord] | None:
        """Reserve ``nbytes``; evict, or wait while only leased shards could go. None: stopped/full."""
        choose: Chooser = self.policy if self.evict else (lambda *_: [])
        usage = self.ledger.usage()
        if usage.quarantined_bytes and usage.total + nbytes + PUBLISH_GROWTH > self.budget:
            purge_quarantine(self.layout, self.ledger)
        while not self.stop.is_set():
            victims = self.ledger.make_room(nbytes, self.budget, choose, evict_to=self._evict_to(nbytes))
            if victims is not None:
                for victim in victims:
                    self.layout.remove(victim.filename)
                return victims
            if not self.evict:
                return None
            if self.ledger.usage().retiring_bytes:
                self._wait_for("backpressure", "the budget is full and the shards that must go are leased by "
                               "running epochs; they are retiring, waiting for those epochs to end")
            else:
                self._wait_for("waiting for training", f"the budget is full of shards fewer than cache.min_uses="
                               f"{self.min_uses} epochs have used; fetching again once epochs use them (set "
                               "cache.min_uses: 0 to rotate shards whether or not they were trained on)")
            self.stop.wait(_BACKPRESSURE_POLL_S)
        return None

    def _evict_to(self, nbytes: int) -> int:
        """The usage (shards, the ``nbytes`` reserved, the ledger) making room for a shard of ``nbytes``
        brings the cache down to: ``cache.low_watermark`` of the budget; ``auto``: :data:`EPOCH_FILL`
        of it in shards plus the rest and one shard more (victims are whole shards: they free up to
        one shard more than asked), at most the budget (then just the next shard's room goes)."""
        if self.low_watermark != "auto":
            return int(self.budget * self.low_watermark)
        rest = nbytes + self.ledger.disk_bytes() + PUBLISH_GROWTH
        return min(self.budget, int(EPOCH_FILL * self.budget) + self.shard_bytes + rest)

    def _wait_for(self, state: str, why: str) -> None:
        """Say once, in the log and the daemon's state, why no room is made yet."""
        if self._state != state:
            log.info("%s: %s", state, why)
            self._say(state)

    def _say(self, state: str, **detail: Any) -> None:
        """Record the daemon's state for ``epochcache status`` when it changes."""
        if state != self._state:
            try:
                # update, not set: the daemon's vitals (started, settings, last_error) share this record
                self.ledger.daemon.update_status(
                    {"pid": os.getpid(), "state": state, "since": time.time(), "error": None, **detail}
                )
            except LedgerFullError:
                return  # a full disk cannot take the state either; said again once it can
            self._state = state
