"""The publisher: turns the rows of one shard into a published shard file under the byte budget.

Flow: ``publish(table, units, cursor)`` -> reserve the shard's exact encoded size in the ledger,
evicting by the configured policy (or waiting while only leased shards could make room) -> write the
file (tmp, fsync, rename) -> publish its record with the sampler's cursor in one ledger transaction
-> delete the evicted shards' files.

Invariants: the bytes under the cache dir never exceed ``cache.max_bytes`` (the shard being written
is reserved before its first byte); a shard under a lease is never deleted; a shard that is not fully
written is never published and its reservation is released.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from epochcache.config import CacheConfig
from epochcache.errors import BudgetError
from epochcache.evict import policy_named
from epochcache.layout import CacheLayout
from epochcache.ledger import Ledger, ShardRecord
from epochcache.shards import encoded_size, write_shard

log = logging.getLogger(__name__)

_BACKPRESSURE_POLL_S = 0.25


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
        self.budget = int(cache.max_bytes)
        self.evict_to = int(cache.max_bytes * cache.low_watermark)
        self.policy = policy_named(cache.eviction)

    def publish(self, table: pa.Table, units: Sequence[str], cursor: dict[str, Any] | None) -> Published | None:
        """Write ``table`` (the rows of ``units``) as one shard and publish it with ``cursor``.

        Returns None, with nothing written or reserved, when ``stop`` is set while waiting for room
        or when ``evict`` is off and the budget is full. Raises :class:`BudgetError` if the shard
        alone cannot fit in the budget.
        """
        table = table.combine_chunks()
        nbytes = encoded_size(table)
        if nbytes > self.budget - self.ledger.disk_bytes():  # a bigger shard than configured: one huge unit
            raise BudgetError(
                f"a shard of {nbytes} bytes does not fit in cache.max_bytes={self.budget}: raise the budget "
                f"or lower cache.shard_bytes (units of the remote are the smallest piece a shard can hold)"
            )
        evicted = self._make_room(nbytes)
        if evicted is None:
            return None
        shard_id = f"{time.time_ns():x}-{uuid.uuid4().hex[:8]}"
        try:
            checksum = write_shard(table, self.layout.tmp_path(shard_id), self.layout.shard_path(shard_id))
        except BaseException:
            self.ledger.clear_reservation()
            raise
        record = ShardRecord(
            id=shard_id, filename=self.layout.shard_path(shard_id).name, nbytes=nbytes,
            rows=table.num_rows, created=time.time(), checksum=checksum, units=tuple(units),
        )
        self.ledger.publish(record, cursor)
        log.debug("published shard %s: %d rows, %d bytes", shard_id, record.rows, nbytes)
        return Published(record, tuple(evicted))

    def _make_room(self, nbytes: int) -> list[ShardRecord] | None:
        """Reserve ``nbytes``; evict, or wait while only leased shards could go. None: stopped/full."""
        choose = self.policy if self.evict else (lambda *_: [])
        announced = False
        while not self.stop.is_set():
            victims = self.ledger.make_room(nbytes, self.budget, choose, evict_to=self.evict_to)
            if victims is not None:
                for victim in victims:
                    (self.layout.shards / victim.filename).unlink(missing_ok=True)
                return victims
            if not self.evict:
                return None
            if not announced:
                announced = True
                log.info("backpressure: the budget is full and the shards that must go are leased by "
                         "running epochs; they are retiring, waiting for those epochs to end")
            self.stop.wait(_BACKPRESSURE_POLL_S)
        return None
