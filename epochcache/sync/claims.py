"""Which units are cached or on their way there, so that none is read (or cached) twice."""

from __future__ import annotations

from collections.abc import Iterable


class Claims:
    """``cached``: units held by a published shard; ``claimed``: units read (or being read) and not
    yet published. A stream that wraps while its last units are still on their way must not read
    them again in its next pass; a unit cached once is never cached again, even across passes."""

    def __init__(self, cached: Iterable[str]) -> None:
        self.cached = set(cached)
        self.claimed: set[str] = set()

    def taken(self, key: str) -> bool:
        """Whether the unit is cached or on its way there: it is not read again."""
        return key in self.cached or key in self.claimed

    def claim(self, key: str) -> None:
        self.claimed.add(key)

    def release(self, key: str) -> None:
        """The unit's read failed or was dropped: it may be read again."""
        self.claimed.discard(key)

    def published(self, units: Iterable[str], evicted: Iterable[str]) -> None:
        """A shard holding ``units`` was published, evicting the shards that held ``evicted``."""
        self.cached.difference_update(evicted)
        units = list(units)
        self.cached.update(units)
        self.claimed.difference_update(units)
