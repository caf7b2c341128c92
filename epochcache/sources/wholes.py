"""Small objects read whole: one GET serves every unit of an object, checked against the store's checksum.

In: the objects a file-format source reads units of (Arrow IPC, Parquet with every column), and the
source's ``parse`` of an object's whole bytes (its footer, checked against the one its units were
listed from). Out, per unit: the object's bytes as one Arrow buffer and their parsed footer, fetched
and parsed once (:meth:`RemoteFiles.fetch_whole`: checked whole against a plain-MD5 ETag or an
``x-amz-checksum-*`` where the store offers one, which no ranged read can be) and held until each
of its units has been read once, or until objects read more recently need the room.

Why: a ranged read per unit plus the footer (twice) costs an object of three units five requests
where two do (the footer's, then the object's), and the bytes of a format without checksums of its
own (Arrow IPC; Parquet written without page CRCs) can be damaged in transit unseen in ranges.

Invariants: an object is fetched and parsed at most once while held (concurrent readers of its
units wait for that one fetch), and its bytes reach no reader before ``parse`` accepted them (a
footer read apart that differs is an error for every waiter, and the next read fetches again); at
most ``keep_bytes`` of objects are held, the least recently read let go first: an object whose other
units were cached already is never read again in a pass, and the ones read by the current mixing
window are the most recent (the caller keeps ``keep_bytes`` at least a window's worth: see
:func:`epochcache.sources.open_source`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

import pyarrow as pa

from epochcache.errors import CorruptObjectError
from epochcache.sources.base import RemoteObject
from epochcache.sources.remote import RemoteFiles

# Objects up to this size are read whole by default (sampler.whole_object_bytes): eight of them, one
# mixing window's worth, stay within a few tens of MB.
WHOLE_OBJECT_BYTES = 8 * 2**20
KEEP_BYTES = 8 * WHOLE_OBJECT_BYTES

P = TypeVar("P")
T = TypeVar("T")
_Key = tuple[str, str | None, int]


class _Held(Generic[P]):
    """One object being fetched or held: its bytes and their parse (a future, for readers arriving
    during the fetch) and the indices of the units read from it."""

    __slots__ = ("data", "read", "size")

    def __init__(self, size: int) -> None:
        self.data: Future[tuple[pa.Buffer, P]] = Future()
        self.read: set[int] = set()
        self.size = size


class WholeObjects(Generic[P]):
    """The objects of one source read whole; see the module docstring. Thread-safe."""

    def __init__(self, remote: RemoteFiles, parse: Callable[[RemoteObject, pa.Buffer], P],
                 most_bytes: int = WHOLE_OBJECT_BYTES, keep_bytes: int = KEEP_BYTES) -> None:
        self.remote, self.parse, self.most_bytes, self.keep_bytes = remote, parse, most_bytes, keep_bytes
        self._held: OrderedDict[_Key, _Held[P]] = OrderedDict()
        self._lock = threading.Lock()

    def wanted(self, obj: RemoteObject) -> bool:
        """Whether ``obj``'s units are read from its whole bytes: remote (a local file has no transit to
        check, nor requests to save) and small enough."""
        return not self.remote.local and 0 < obj.size <= self.most_bytes

    def bytes_of(self, obj: RemoteObject) -> tuple[pa.Buffer, P]:
        """All of ``obj``'s bytes (its listed version) and their parse, fetched and parsed by the first
        caller; the others wait for it. A failed fetch or parse raises to every waiter, and the next
        call fetches again."""
        key = _key(obj)
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
            got = data, self.parse(obj, data)
        except BaseException as exc:
            self._drop(key, held)
            held.data.set_exception(exc)
            raise
        held.data.set_result(got)
        self._make_room()
        return got

    def unit(self, obj: RemoteObject, index: int, decode: Callable[[pa.Buffer, P], T],
             units: Callable[[P], int]) -> T:
        """Unit ``index`` of ``obj``: ``decode(its bytes, their parse)``. A decode that fails
        (:class:`CorruptObjectError`) lets the bytes go (:meth:`forget`); once each of the object's
        ``units(parse)`` units was decoded, it is let go (:meth:`done`)."""
        data, parsed = self.bytes_of(obj)
        try:
            decoded = decode(data, parsed)
        except CorruptObjectError:
            self.forget(obj)
            raise
        self.done(obj, index, units(parsed))
        return decoded

    def forget(self, obj: RemoteObject) -> None:
        """Let ``obj``'s bytes go (a unit's decode failed): the next read fetches them again, as a retry
        must where the store offers no checksum to have checked them."""
        key = _key(obj)
        with self._lock:
            held = self._held.get(key)
        if held is not None and held.data.done():
            self._drop(key, held)

    def done(self, obj: RemoteObject, index: int, units: int) -> None:
        """Unit ``index`` of ``obj`` (of ``units``) was read: once every one was, the object is let go."""
        key = _key(obj)
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

    def _drop(self, key: _Key, held: _Held[P]) -> None:
        with self._lock:
            if self._held.get(key) is held:
                del self._held[key]

    def _make_room(self) -> None:
        """Let the least recently read fetched objects go while more than ``keep_bytes`` are held (the
        most recent stays)."""
        with self._lock:
            total = sum(held.size for held in self._held.values())
            for key in list(self._held):
                if total <= self.keep_bytes or len(self._held) == 1:
                    break
                held = self._held[key]
                if held.data.done():
                    del self._held[key]
                    total -= held.size


def footer_differs(obj: RemoteObject) -> CorruptObjectError:
    """The error of a footer read apart that is not the one in the object's whole bytes."""
    return CorruptObjectError(f"{obj.path}: its footer as read apart differs from the one in its whole bytes: "
                              "damaged in transit")


def _key(obj: RemoteObject) -> _Key:
    """An object's version as held: a store without ETags still changes size or mtime (in its etag)."""
    return obj.path, obj.etag, obj.size
