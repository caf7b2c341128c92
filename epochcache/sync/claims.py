"""Which units are cached or on their way there, so that none is read (or cached) twice."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Claims:
    """``cached``: which of some unit keys a published shard holds (``Ledger.cached_units``: an
    index lookup, so the daemon never loads the cache's unit list); ``claimed``: units read (or
    being read) and not yet published. A stream that wraps while its last units are still on their
    way must not read them again in its next pass; a unit cached is not cached again while its shard
    lives."""

    def __init__(self, cached: Callable[[Iterable[str]], set[str]]) -> None:
        self._cached = cached
        self.claimed: set[str] = set()

    def taken(self, key: str) -> bool:
        """Whether the unit is cached or on its way there: it is not read again. ``claimed`` is asked
        first: a publish enters the ledger before it leaves ``claimed``, so no unit is in neither."""
        return key in self.claimed or bool(self._cached((key,)))

    def claim(self, key: str) -> None:
        self.claimed.add(key)

    def release(self, key: str) -> None:
        """The unit's read failed or was dropped: it may be read again."""
        self.claimed.discard(key)

    def published(self, units: Iterable[str]) -> None:
        """A shard holding ``units`` is in the ledger: they are cached, no longer on their way."""
        self.claimed.difference_update(units)
