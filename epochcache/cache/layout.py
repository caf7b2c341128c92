"""Where things live under a cache directory; the one module that knows the layout.

::

    <dir>/shards/<id>.<checksum>.arrow   published shards (Arrow IPC files)
    <dir>/shards/<id>.arrow.tmp          a shard being written; never read, removed at daemon start
    <dir>/quarantine/<file name>         shards that failed their checksum or Arrow structure
    <dir>/ledger/ledger.sqlite3          the SQLite ledger: the truth about what is published
    <dir>/footers/                       remote files' footers, kept by the daemon (diskcache)
    <dir>/daemon.lock                    held (flock) by the one sync daemon of this cache dir

The checksum in a shard's name lets a file the ledger does not know be checked before it is
adopted. No path here is derived from a remote key: shard ids are made locally.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from epochcache.errors import CacheError

SHARD_SUFFIX = ".arrow"
TMP_SUFFIX = ".arrow.tmp"
_SHARD_NAME = re.compile(r"([0-9a-z-]+)\.([0-9a-f]{32})\.arrow")


def bytes_under(root: Path) -> int:
    """Bytes of the files under ``root`` (0 if it is absent): one ``lstat`` per file name os.walk lists
    (a third of the cost of ``Path.rglob`` and a ``stat`` per path: 0.3 s for 100,000 shards)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:  # removed since the listing (an eviction, a journal): no longer held
                continue
    return total


def parse_shard_name(name: str) -> tuple[str, str] | None:
    """``(shard id, checksum)`` from a published shard's file name; None if it is not one."""
    match = _SHARD_NAME.fullmatch(name)
    return (match[1], match[2]) if match else None


@dataclass(frozen=True)
class CacheLayout:
    """Paths of one cache directory; creating it makes the folders."""

    root: Path

    @classmethod
    def create(cls, root: str | Path) -> CacheLayout:
        """The layout of ``root``, its folders made; :class:`CacheError` if they cannot be."""
        layout = cls(Path(root).resolve())
        try:
            for folder in (layout.shards, layout.quarantine, layout.ledger):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the cache dir {str(root)!r}: {exc.strerror}; check cache.dir") from exc
        return layout

    # Cached: a path is built once per layout, not once per shard (an epoch of 100,000 shards asked
    # for the shard folder twice per shard, 0.5 s of its build in pathlib).
    @cached_property
    def shards(self) -> Path:
        return self.root / "shards"

    @cached_property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @cached_property
    def ledger(self) -> Path:
        return self.root / "ledger"

    @cached_property
    def footers(self) -> Path:
        return self.root / "footers"

    @cached_property
    def lock(self) -> Path:
        return self.root / "daemon.lock"

    def shard_file(self, filename: str) -> str:
        """The path of the shard file ``filename`` as a str, for loops over every shard of an epoch
        (a Path per shard cost 5 µs: 0.5 s of building an epoch of 100,000 shards)."""
        return os.path.join(self.shards, filename)

    def shard_path(self, shard_id: str, checksum: str) -> Path:
        return self.shards / f"{shard_id}.{checksum}{SHARD_SUFFIX}"

    def tmp_path(self, shard_id: str) -> Path:
        return self.shards / f"{shard_id}{TMP_SUFFIX}"

    def remove(self, filename: str) -> None:
        """Delete a shard file that the ledger no longer records, from shards/ or quarantine/ (one
        system call when it is in shards/, with no Path made: an eviction batch removes 100,000)."""
        for folder in (self.shards, self.quarantine):
            try:
                os.unlink(os.path.join(folder, filename))
                return
            except FileNotFoundError:
                pass
