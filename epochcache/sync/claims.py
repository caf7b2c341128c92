"""Which units are cached or on their way there, so that none is read (or cached) twice."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from epochcache.sources.base import unit_path


class Claims:
    """``cached``: which of some unit keys a published shard holds (``Ledger.cached_units``: an
    index lookup, so the daemon never loads the cache's unit list); ``claimed``: units read (or
    being read) and not yet published. A stream that wraps while its last units are still on their
    way must not read them again in its next pass; a unit cached is not cached again while its shard
    lives.

    ``outdated``: units claimed when a listing showed their object rewritten: read (or being read,
    pinned to the listed version) from the version the remote replaced, so their rows must never be
    published (the daemon drops them, :meth:`drop`), or the new version would never be read (its
    units would count as cached). They stay claimed until dropped, so none is read twice at once."""

    def __init__(self, cached: Callable[[Iterable[str]], set[str]]) -> None:
        self._cached = cached
        self.claimed: set[str] = set()
        self.outdated: set[str] = set()

    def taken(self, key: str) -> bool:
        """Whether the unit is cached or on its way there: it is not read again. ``claimed`` is asked
        first: a publish enters the ledger before it leaves ``claimed``, so no unit is in neither."""
        return key in self.claimed or bool(self._cached((key,)))

    def claim(self, key: str) -> None:
        self.claimed.add(key)

    def release(self, key: str) -> None:
        """The unit's read failed or was dropped: it may be read again (if it was outdated, the next
        claim of it is of the new version)."""
        self.claimed.discard(key)
        self.outdated.discard(key)

    def published(self, units: Iterable[str]) -> None:
        """A shard holding ``units`` is in the ledger: they are cached, no longer on their way."""
        self.claimed.difference_update(units)

    def outdate(self, paths: Collection[str]) -> int:
        """The objects at ``paths`` were rewritten: the units of theirs claimed now become outdated;
        how many."""
        wanted = set(paths)
        found = {key for key in self.claimed if unit_path(key) in wanted}
        self.outdated |= found
        return len(found)

    def drop(self, key: str) -> bool:
        """Whether ``key`` was outdated; if so it is forgotten (unclaimed: read again, of its new version)."""
        if key not in self.outdated:
            return False
        self.outdated.discard(key)
        self.claimed.discard(key)
        return True
