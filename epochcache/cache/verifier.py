"""BackgroundVerifier: checksums shards not yet verified on this host, off the batch path.

In: shard records handed over by the loader (on its cleanup thread) once the trainer is back from an
epoch's first batch; out: each record's file checked against its checksum on this verifier's own
thread, then recorded in the ledger (``Ledger.mark_verified``, so no process on this host checks it
again) or quarantined.

Invariants: nothing is checksummed before an epoch's first batch, and a shard is checked at most
once per verifier (and, through the ledger, once per host: shards the daemon wrote are verified at
write). A shard found damaged leaves the cache's shard set, so later epochs never read it; an epoch
already reading it may have read some of its rows (the price of not reading every byte up front).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger, ShardRecord
from epochcache.cache.quarantine import quarantine_shard
from epochcache.cache.shards import verify_shard
from epochcache.errors import ShardCorruptError

log = logging.getLogger(__name__)

_STOP = None


class BackgroundVerifier:
    """One thread checksumming submitted records in order, into the ledger and shards of ``layout``.

    The thread writes through a ledger connection of its own: its quarantines are then commits by
    another connection to the loader's ledger, which ``ledger.db.version()`` shows (the loader's check
    that no shard left since an epoch was prepared rests on that)."""

    def __init__(self, layout: CacheLayout):
        self._layout = layout
        self._queue: queue.Queue[ShardRecord | None] = queue.Queue()
        self._seen: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="epochcache-verify", daemon=True)
        self._thread.start()

    def submit(self, records: Iterable[ShardRecord]) -> int:
        """Queue the records not verified yet and not queued before; returns how many were queued.
        From one thread at a time (the loader's cleanup thread): the records seen are not locked."""
        fresh = [r for r in records if not r.verified and r.id not in self._seen]
        for record in fresh:
            self._seen.add(record.id)
            self._queue.put(record)
        return len(fresh)

    def close(self) -> None:
        """Stop after the record being checked (the rest are left for a later loader); join the thread."""
        while True:  # drop what is queued: the ledger still says unverified, so a later loader checks it
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        ledger = Ledger(self._layout.ledger)
        try:
            while (record := self._queue.get()) is not _STOP:
                self._check(ledger, record)
        finally:
            ledger.close()

    def _check(self, ledger: Ledger, record: ShardRecord) -> None:
        try:
            verify_shard(self._layout.shards / record.filename, record.checksum)
        except FileNotFoundError:
            return  # evicted or quarantined meanwhile: nothing left to check
        except ShardCorruptError as exc:
            quarantine_shard(self._layout, ledger, record, f"failed verification: {exc}")
            return
        ledger.mark_verified([record.id])
