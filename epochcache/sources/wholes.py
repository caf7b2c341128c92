"""Small objects read whole: one GET serves every unit of an object, checked against the store's checksum.

In: the objects a file-format source reads units of (Arrow IPC, Parquet with every column). Out, per
unit: the object's bytes as one Arrow buffer, fetched once by :meth:`RemoteFiles.fetch_whole` (so
checked whole against a plain-MD5 ETag or an ``x-amz-checksum-*``, which no ranged read can be) and
held until each of its units has been read once, or until objects read more recently need the room.

Why: a ranged read per unit plus the footer (twice) costs an object of three units five requests
where two do (the footer's, then the object's), and the bytes of a format without checksums of its
own (Arrow IPC; Parquet written without page CRCs) can be damaged in transit unseen in ranges. An object's footer,
read first to list its units, is checked against the whole object's when it arrives (see the
sources), so no unit is decoded with a footer the checksum did not cover.

Invariants: an object is fetched at most once while held (concurrent readers of its units wait for
the one fetch); at most ``keep_bytes`` of objects are held, the least recently read let go first
(an object whose other units were cached already is never read again this pass); an object let
go before all its units were read is not fetched whole again until a new version is listed (its
remaining units are read in ranges, with the footer its whole read checked): a window too small
for the mixing never turns one object into a whole download per unit.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

import pyarrow as pa

from epochcache.sources.base import RemoteObject
from epochcache.sources.remote import RemoteFiles

# Objects up to this size are read whole by default (sampler.whole_object_bytes): eight of them, one
# mixing window's worth, stay within a few tens of MB.
WHOLE_OBJECT_BYTES = 8 * 2**20
KEEP_BYTES = 256 * 2**20
# Objects let go early that are remembered (read in ranges): forgetting them all costs each one more
# whole read, while the set stays small whatever the listing's size.
_LET_GO_MOST = 100_000

log = logging.getLogger(__name__)

_Key = tuple[str, str | None]


class _Held:
    """One object being fetched or held: its bytes (a future, for readers arriving during the fetch)
    and the indices of the units read from it."""

    __slots__ = ("data", "read", "size")

    def __init__(self, size: int) -> None:
        self.data: Future[pa.Buffer] = Future()
        self.read: set[int] = set()
        self.size = size


class WholeObjects:
    """The objects of one source read whole; see the module docstring. Thread-safe."""

    def __init__(self, remote: RemoteFiles, most_bytes: int = WHOLE_OBJECT_BYTES, keep_bytes: int = KEEP_BYTES) -> None:
        self.remote, self.most_bytes, self.keep_bytes = remote, most_bytes, keep_bytes
        self._held: OrderedDict[_Key, _Held] = OrderedDict()
        self._let_go: set[_Key] = set()  # objects dropped for room before all their units were read
        self._lock = threading.Lock()

    def wanted(self, obj: RemoteObject) -> bool:
        """Whether ``obj``'s units are read from its whole bytes: remote (a local file has no transit to
        check, nor requests to save), small enough, and not let go for room."""
        return not self.remote.local and 0 < obj.size <= self.most_bytes and (obj.path, obj.etag) not in self._let_go

    def bytes_of(self, obj: RemoteObject) -> pa.Buffer:
        """All of ``obj``'s bytes (its listed version), fetched by the first caller; the others wait for
        that fetch. A failed fetch raises to every waiter, and the next call fetches again."""
        key = (obj.path, obj.etag)
        with self._lock:
            held = self._held.get(key)
            fetcher = held is None
            if held is None:
                held = self._held[key] = _Held(obj.size)
            self._held.move_to_end(key)  # the least recently read is let go first
        if not fetcher:
            return held.data.result()
        try:
            data = pa.py_buffer(self.remote.fetch_whole(obj))
        except BaseException as exc:
            with self._lock:
                if self._held.get(key) is held:
                    del self._held[key]
            held.data.set_exception(exc)
            raise
        held.data.set_result(data)
        self._make_room()
        return data

    def forget(self, obj: RemoteObject) -> None:
        """Let ``obj``'s bytes go (a read of them failed): the next unit's read fetches them again,
        as a retry must where the store offers no checksum to have checked them."""
        with self._lock:
            held = self._held.get((obj.path, obj.etag))
            if held is not None and held.data.done():
                del self._held[(obj.path, obj.etag)]

    def done(self, obj: RemoteObject, index: int, units: int) -> None:
        """Unit ``index`` of ``obj`` (of ``units``) was read: once every one was, the object is let go."""
        key = (obj.path, obj.etag)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.read.add(index)
                if len(held.read) >= units:
                    del self._held[key]

    def held_bytes(self) -> int:
        """The bytes of the objects held (fetched or being fetched)."""
        with self._lock:
            return sum(held.size for held in self._held.values())

    def _make_room(self) -> None:
        """Let the oldest fetched objects go while more than ``keep_bytes`` are held (the newest stays)."""
        with self._lock:
            total = sum(held.size for held in self._held.values())
            for key in list(self._held):
                if total <= self.keep_bytes or len(self._held) == 1:
                    break
                held = self._held[key]
                if held.data.done():
                    del self._held[key]
                    total -= held.size
                    if not self._let_go:  # (info: units already cached, never read this pass, are one reason)
                        log.info("%s: objects read whole are let go, for room (%d bytes held at most), before each of "
                                 "their units was read from them: the rest are read in ranges. Units already cached "
                                 "are one reason; a mixing window larger than the room (mix_units x "
                                 "whole_object_bytes over max_inflight_bytes) another", self.remote.url,
                                 self.keep_bytes)
                    if len(self._let_go) >= _LET_GO_MOST:
                        self._let_go.clear()
                    self._let_go.add(key)
