"""Skip bookkeeping: units (or whole objects) that could not be read are recorded in the ledger,
the pass goes on without them, and at the pass end they are read once more.

In: failures of reads (:data:`SKIPPABLE`); out: ledger ``skipped`` records (path, size, ETag,
index, pass, stream, reason), the ``units_skipped`` counter, and :attr:`SkipBook.unread`, the units this
run skipped and never read afterwards. Invariant: a skip never stops the daemon; only errors of
configuration (:class:`~epochcache.errors.SourceError` other than a vanished object) do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pyarrow as pa

from epochcache.cache.ledger import Ledger
from epochcache.errors import (
    CorruptObjectError,
    FetchFailedError,
    ObjectDeniedError,
    ObjectMissingError,
    OversizeUnitError,
    causes,
)
from epochcache.sources import RemoteObject, Unit
from epochcache.sources.retry import Retrier, describe
from epochcache.sources.s3errors import status_of
from epochcache.sync.claims import Claims
from epochcache.sync.notes import note
from epochcache.sync.report import SyncReport
from epochcache.sync.stream import Stream
from epochcache.sync.vitals import Vitals

log = logging.getLogger(__name__)

# What skips a unit instead of stopping the daemon: transient failures that outlived their retries,
# objects deleted mid-pass, and bad bytes (damaged metadata or payload, checksum mismatches).
SKIPPABLE = (FetchFailedError, ObjectMissingError, CorruptObjectError)

Read = Callable[[Stream, Unit], pa.Table]


class SkipBook:
    """Records failed units in the ledger and reads them again at their pass end."""

    def __init__(self, ledger: Ledger, retrier: Retrier, claims: Claims, report: SyncReport,
                 vitals: Vitals, stop: threading.Event) -> None:
        self.ledger, self.retrier, self.claims, self.report, self.stop = ledger, retrier, claims, report, stop
        self.vitals = vitals
        self._unread: set[str] = set()

    @property
    def unread(self) -> int:
        """Units (or whole objects) this run skipped and did not read afterwards."""
        return len(self._unread)

    def failing(self, key: str) -> bool:
        """Whether ``key`` (a unit's) was skipped by this run and has not been read since."""
        return key in self._unread

    def read(self, key: str) -> None:
        """``key`` (a unit's) was read: no longer unread, its skip record (of a pass before) dropped."""
        if key in self._unread:
            self._unread.discard(key)
            note(self.ledger.daemon.drop_skipped, key)

    def skipped_objects(self, pass_: int) -> set[str]:
        """Keys of the skip records of ``pass_`` (``<path>#*`` for an object whose metadata failed)."""
        return {key for key, info in self.ledger.daemon.skipped().items() if info.get("pass") == pass_}

    def skip(self, stream: Stream, pass_: int, key: str, obj: RemoteObject, index: int | None,
             exc: Exception) -> None:
        """Record a unit (or a whole object: ``index`` None) that failed, for the retry at pass end."""
        log.warning("skipping %s for now: %s", key, describe(exc))
        self.report.units_skipped += 1
        self._unread.add(key)
        note(self.ledger.counters.incr, "units_skipped")
        self.vitals.failed(what_failed(exc), f"{key}: {describe(exc)}")
        note(self.ledger.daemon.set_skipped, key, {"path": obj.path, "size": obj.size, "etag": obj.etag,
                                                   "index": index, "pass": pass_, "stream": stream.name,
                                                   "error": describe(exc)})

    def retry(self, stream: Stream, pass_: int, read: Read) -> Iterator[tuple[Unit, pa.Table]]:
        """Yield the rows of ``stream``'s skipped units of this pass that read now; forget those whose
        object is gone, and the stream's records of earlier passes; a unit failing again stays
        recorded (``final``) until the next pass ends, counted as unread, and the pass moves on without it."""
        for key, info in self.ledger.daemon.skipped().items():
            if info.get("stream", "") == stream.name and info.get("pass", pass_) < pass_:
                # No pass reads an earlier pass's record (this one read its unit, or recorded it anew):
                # kept, they would grow with every unit a long run failed to read, read at each pass end.
                note(self.ledger.daemon.drop_skipped, key)
                continue
            if (info.get("pass") != pass_ or info.get("stream", "") != stream.name or info.get("final")
                    or self.stop.is_set()):
                continue
            # The version this pass listed: one rewritten since is gone for the pass (its rows read so far
            # are of the listed version; the next pass lists, and reads, the new one)
            obj = RemoteObject(info["path"], info["size"], info.get("etag"))
            try:
                units = stream.slicer.units(
                    self.retrier.call(stream.source.units, obj, what=f"metadata of {obj.path}"), pass_)
                wanted = units if info["index"] is None else [units[info["index"]]]
                for unit in wanted:
                    if not self.claims.taken(unit.key):
                        table = read(stream, unit)
                        self.claims.claim(unit.key)
                        yield unit, table
            except ObjectMissingError as exc:
                log.warning("dropping %s: %s", key, describe(exc))
                note(self.ledger.counters.incr, "objects_missing")
            except (FetchFailedError, CorruptObjectError) as exc:
                log.warning("%s failed again at the end of pass %d: %s", key, pass_, describe(exc))
                self.vitals.failed(what_failed(exc), f"{key} failed again at the pass end: {describe(exc)}")
                self._unread.add(key)
                note(self.ledger.daemon.set_skipped, key, {**info, "final": True, "error": describe(exc)})
                continue
            self._unread.discard(key)
            note(self.ledger.daemon.drop_skipped, key)


def what_failed(exc: Exception) -> str:
    """What a read or listing given up says of the remote, for the daemon's last error: a store that
    answered with a server error (after the retries) is failing, one that never answered unreachable."""
    if isinstance(exc, ObjectDeniedError):
        return "object refused"
    if isinstance(exc, FetchFailedError):
        status = next((status for status in map(status_of, causes(exc)) if status is not None), None)
        return "remote unreachable" if status is None else f"remote failing (HTTP {status})"
    if isinstance(exc, OversizeUnitError):
        return "unit too large"
    return "corrupt object" if isinstance(exc, CorruptObjectError) else "object missing"

