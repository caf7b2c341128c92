"""The remote listing of one pass of one source, kept in the ledger in pages and read back page by page.

Flow: :func:`store_listing` streams a source's pages of objects into the ledger as they arrive and
returns a :class:`PagedListing`, a read-only sequence over them that holds only a few pages in
memory. A daemon restarted mid-pass reopens the same listing with :meth:`PagedListing.open`, so the
sampler's order (a permutation of listing positions) is the same across restarts. Each source (a
*stream*, by its configured name; ``""`` for the single ``source:``) has its own listing in the ledger.

Invariant: a listing header with a ``count`` is written only after its last page, so a listing
interrupted part-way is never used; the next start lists again.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from epochcache.cache.ledger import Ledger
from epochcache.sources.base import RemoteObject

_PAGES_HELD = 8


class PagedListing(Sequence[RemoteObject]):
    """Objects ``0..count-1`` of a stored listing; an index is looked up in its page."""

    def __init__(self, ledger: Ledger, starts: list[int], count: int, stream: str = "",
                 nbytes: int | None = None) -> None:
        """``nbytes``: the listed objects' sizes summed (None for a listing stored without it)."""
        self._ledger, self._starts, self._count, self._stream = ledger, starts, count, stream
        self.nbytes = nbytes
        self._page = functools.lru_cache(maxsize=_PAGES_HELD)(self._load)

    @classmethod
    def open(cls, ledger: Ledger, header: dict[str, Any], stream: str = "") -> PagedListing | None:
        """The listing ``header`` (from ``ledger.daemon.listing(stream)``) describes; None if it is incomplete."""
        if header.get("count") is None:
            return None
        return cls(ledger, list(header["starts"]), int(header["count"]), stream, header.get("bytes"))

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> RemoteObject: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RemoteObject]: ...

    def __getitem__(self, index: int | slice) -> RemoteObject | Sequence[RemoteObject]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not 0 <= index < self._count:
            raise IndexError(f"listing index {index} out of range 0..{self._count - 1}")
        number = bisect.bisect_right(self._starts, index) - 1
        path, size, etag = self._page(number)[index - self._starts[number]]
        return RemoteObject(path, size, etag)

    def _load(self, number: int) -> list[tuple[str, int, str | None]]:
        page = self._ledger.daemon.listing_page(number, self._stream)
        if page is None:
            raise LookupError(f"listing page {number} is missing from the ledger: delete the cache dir's "
                              "ledger/ folder to start a fresh listing")
        return page


def store_listing(
    ledger: Ledger, pages: Iterator[list[RemoteObject]], header: dict[str, Any], stream: str = "",
    listed: Callable[[int], None] | None = None,
) -> PagedListing:
    """Write ``pages`` into the ledger as ``stream``'s listing as they arrive, then its header
    (``header`` plus ``count``, the page ``starts`` and the objects' total ``bytes``); return the listing
    over them. ``listed(count)`` is told the objects listed so far after each page (progress)."""
    ledger.daemon.set_listing(stream, {**header, "count": None})
    ledger.daemon.drop_listing_pages(stream)
    starts, count, nbytes = [], 0, 0
    for number, page in enumerate(pages):
        ledger.daemon.set_listing_page(number, [(obj.path, obj.size, obj.etag) for obj in page], stream)
        starts.append(count)
        count += len(page)
        nbytes += sum(obj.size for obj in page)
        if listed is not None:
            listed(count)
    ledger.daemon.set_listing(stream, {**header, "count": count, "starts": starts, "bytes": nbytes})
    return PagedListing(ledger, starts, count, stream, nbytes)
