"""Which version of a listed object a read is of (invariant: the bytes of one read all come from the
version the listing saw): :func:`etag_of`, the version a listing entry names, and
:class:`VersionPins`, the ETag each read of a source is pinned to and the check of each reply.

- S3: the listing records each object's ETag; every GET carries ``If-Match`` with it, so a rewritten
  object answers 412 instead of bytes of another version cut at the stale size. (Of an object listed
  without one, whose version is then its listing's LastModified and size, the ETag the first read of
  that listed version was served with pins the reads after it; of replies without an ETag, their
  Last-Modified, compared with the first reply's and with a listing's without ETags. A store whose
  GETs refuse an object's listed ETag while a listing still names it has its listings' ETags given
  up: each object's reads are pinned to its first reply's.) (ListObjectsV2 names no VersionId; the
  ETag pins versioned buckets as well.) The reply's ETag is compared too (without quotes, ``W/`` or
  case), for stores that ignore ``If-Match`` (what a store is found to refuse: :mod:`epochcache.sources.s3gets`).
- Local files: the etag is ``<mtime>-<size>``; it is compared with a fresh ``stat`` before and after
  each read (:class:`~epochcache.sources.remote.RemoteFiles`).
- Other filesystems: the etag is recorded when their listing has one, but reads are not pinned;
  whole-object reads still ask one byte past the listed size, so growth is seen.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from epochcache.errors import ObjectMissingError
from epochcache.sources.base import RemoteObject, bare_etag

# Listed versions whose reads are pinned to their first reply (see VersionPins.pin): the most recently
# read this many.
_SERVED_ETAGS = 65536
# The version of an S3 object listed without an ETag: its listing's LastModified (seconds) and size.
_MODIFIED = "modified:"


def etag_of(info: dict[str, Any]) -> str | None:
    """The version a listing entry names: its ETag where the store has one, else ``<mtime>-<size>``
    (local files), else ``modified:<LastModified>-<size>`` (an S3 listing without ETags)."""
    for name in ("ETag", "etag"):
        if info.get(name):
            return str(info[name])
    if info.get("mtime") is not None:
        return f"{info['mtime']}-{info['size']}"
    modified = seconds(info.get("LastModified"))
    if modified is not None:  # (an fsspec info dict, or a raw ListObjectsV2 entry)
        return f"{_MODIFIED}{modified!r}-{info.get('size', info.get('Size'))}"
    return None


def seconds(when: Any) -> float | None:
    """A listing's or a reply's LastModified (botocore parses both to datetimes) in seconds, or None
    (also for a time botocore parsed that has none: an offset past a day, a year out of range)."""
    timestamp = getattr(when, "timestamp", None)
    try:
        return float(timestamp()) if callable(timestamp) else None
    except (ValueError, OverflowError, OSError):
        return None


def listed_modified(obj: RemoteObject) -> float | None:
    """The LastModified of the listing's ``modified:`` version of ``obj``, if it has one."""
    if not obj.etag or not obj.etag.startswith(_MODIFIED):
        return None
    return float(obj.etag[len(_MODIFIED):].rsplit("-", 1)[0])


def changed(url: str, how: str) -> ObjectMissingError:
    """The error of a read of ``url`` finding its object changed since it was listed (``how``)."""
    return ObjectMissingError(f"{url} changed since it was listed ({how}): skipped for this pass; the next pass "
                              "lists and reads its new version")


def names_listed(obj: RemoteObject, etag: str | None, size: int | None) -> bool:
    """Whether an ETag and size (a HEAD's, a listing entry's) name ``obj``'s listed version (ETags
    compared as :func:`bare_etag`)."""
    return bool(obj.etag and etag and bare_etag(etag) == bare_etag(obj.etag) and size == obj.size)


class VersionPins:
    """The versions one source's reads are pinned to (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self.listing_etags = True  # until the store's GETs name an unchanged object otherwise (S3Gets)
        self._served: OrderedDict[tuple[str, str | None], _Served] = OrderedDict()  # see pin
        self._lock = threading.Lock()

    def pin(self, obj: RemoteObject) -> str | None:
        """The ETag reads of ``obj`` are pinned to (by If-Match): the listing's, or for an object listed
        without one, the one its first read of this listed version was served with (so a footer and the
        units read after it are of one version: an object rewritten since is changed, as with a listed
        ETag); None if neither is known."""
        listed = self.listed_etag(obj)
        if listed is not None:
            return listed
        with self._lock:
            first = self._served.get((obj.path, obj.etag))
            return first.etag if first is not None else None

    def listed_etag(self, obj: RemoteObject) -> str | None:
        """The store's ETag the listing gave ``obj``: None for none, for a ``modified:`` version, or
        once the store's GETs showed that its listing's ETags are not theirs (see
        :class:`~epochcache.sources.s3gets.S3Gets`)."""
        return obj.etag if self.listing_etags and obj.etag and not obj.etag.startswith(_MODIFIED) else None

    def change(self, obj: RemoteObject, reply: dict[str, Any]) -> str | None:
        """How the version ``reply`` (botocore's parsed GetObject) served differs from the one ``obj``'s
        reads are pinned to; None if it is that version (a store that ignores If-Match serves another
        version without a word: its reply's ETag names it).

        Without a listed ETag and a reply's to compare, the reply's ETag, else its Last-Modified, is
        compared with the first reply's for this listed version (so the reads of one pass are of one
        version), and a Last-Modified with the listing's, where it has one and no ETag. (Only then is
        a first reply kept: reads pinned by listed ETags keep none in memory.)"""
        served, modified = reply.get("ETag") or None, seconds(reply.get("LastModified"))  # ("": none sent)
        listed = self.listed_etag(obj)
        if listed and served:
            return None if bare_etag(served) == bare_etag(listed) else f"its ETag went from {listed} to {served}"
        was = listed_modified(obj)
        # (a listing's LastModified has milliseconds, Last-Modified whole seconds)
        if not served and was is not None and modified is not None and abs(modified - was) >= 1:
            return f"its Last-Modified went from {was:.0f} to {modified:.0f}"
        this = _Served(served, modified)
        first = self._first_served(obj, this)
        return None if first is None else f"its first reply was of {first}, this one of {this}"

    def _first_served(self, obj: RemoteObject, served: _Served) -> _Served | None:
        """Compare ``served`` with what the first reply of this listed version of ``obj`` showed (kept
        from it on, filled in by later replies: an ETag after replies without one): None if they
        agree (or this is the first), else the first's."""
        key = (obj.path, obj.etag)
        with self._lock:
            first = self._served.setdefault(key, served)
            self._served.move_to_end(key)
            if len(self._served) > _SERVED_ETAGS:
                self._served.popitem(last=False)
            if not first.same(served.etag, served.modified):
                return first
            self._served[key] = first.merged(served)
            return None


class _Served(NamedTuple):
    """What a reply shows of the version it served: its ETag (as sent: If-Match repeats it), its
    Last-Modified in seconds; either may be None (not sent)."""

    etag: str | None
    modified: float | None

    def same(self, etag: str | None, modified: float | None) -> bool:
        """Whether a reply showing ``etag`` and ``modified`` may be of this version: their ETags agree
        where both show one, else their Last-Modified where both show one (a store may stamp replies of
        one version with the time they were sent; replies without either cannot be told apart)."""
        if etag is not None and self.etag is not None:
            return bare_etag(etag) == bare_etag(self.etag)
        return modified is None or self.modified is None or modified == self.modified

    def merged(self, other: _Served) -> _Served:
        """This version, with what ``other`` (the same) shows where this shows nothing."""
        return _Served(self.etag or other.etag, self.modified if self.modified is not None else other.modified)

    def __str__(self) -> str:
        return f"ETag {self.etag}" if self.etag else f"Last-Modified {self.modified:.0f}" \
            if self.modified is not None else "unknown"
