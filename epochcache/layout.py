"""Where things live under a cache directory; the one module that knows the layout.

::

    <dir>/shards/<id>.arrow        published shards (Arrow IPC files)
    <dir>/shards/<id>.arrow.tmp    a shard being written; never read, removed at daemon start
    <dir>/ledger/                  the diskcache/SQLite ledger: the truth about what is published
    <dir>/daemon.lock              held (flock) by the one sync daemon of this cache dir
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epochcache.errors import CacheError

SHARD_SUFFIX = ".arrow"
TMP_SUFFIX = ".arrow.tmp"


@dataclass(frozen=True)
class CacheLayout:
    """Paths of one cache directory; creating it makes the folders."""

    root: Path

    @classmethod
    def create(cls, root: str | Path) -> CacheLayout:
        """The layout of ``root``, its folders made; :class:`CacheError` if they cannot be."""
        layout = cls(Path(root).resolve())
        try:
            layout.shards.mkdir(parents=True, exist_ok=True)
            layout.ledger.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the cache dir {str(root)!r}: {exc.strerror}; check cache.dir") from exc
        return layout

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger"

    @property
    def lock(self) -> Path:
        return self.root / "daemon.lock"

    def shard_path(self, shard_id: str) -> Path:
        return self.shards / f"{shard_id}{SHARD_SUFFIX}"

    def tmp_path(self, shard_id: str) -> Path:
        return self.shards / f"{shard_id}{TMP_SUFFIX}"
