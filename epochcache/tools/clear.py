"""``epochcache clear``: empty a cache directory on purpose, so it can hold another dataset.

Flow: Config -> :func:`clear_cache` -> counts of what was deleted. Under the daemon lock (so no sync
daemon runs, and none starts meanwhile) and only while no trainer holds a live lease, it deletes the
shard files, the quarantined shards, then the ledger (with it the dataset identity, the cursor, the
listing and the skipped units) and the remote files' footers, and leaves the empty folders of a fresh
cache.

Invariant: shard files go before the ledger, so a clear interrupted half-way leaves records without
files (dropped at the next daemon start) and never unrecorded shards of the old dataset that a
daemon start would adopt. A cache dir that does not exist is refused, never created.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.lockfile import exclusive
from epochcache.cache.progress import progress_bar
from epochcache.config import Config
from epochcache.errors import CacheError


def existing_layout(config: Config, ledger_lost: bool = False) -> CacheLayout:
    """The layout of ``cache.dir`` if it holds a cache (its ledger folder, or with ``ledger_lost`` its
    shards folder: ``verify --fix`` rebuilds a lost ledger from the shard files); :class:`CacheError`
    naming the path and what is there otherwise. Creates nothing: a mistyped ``cache.dir`` stays absent."""
    layout = CacheLayout(Path(config.cache.dir).resolve())
    if layout.ledger.is_dir() or (ledger_lost and layout.shards.is_dir()):
        return layout
    if layout.root.is_dir():
        state = "holds no epochcache cache"
    elif layout.root.exists():
        state = "is a file, not a folder"
    else:
        state = "does not exist"
    raise CacheError(f"cache.dir {str(layout.root)!r} {state}: check cache.dir in the config "
                     "(only `epochcache sync` creates a cache)")


def clear_cache(config: Config, progress: bool | None = False) -> dict[str, int]:
    """Delete every shard, quarantined shard, the ledger and the footers of ``config.cache.dir``; returns
    ``{"shards": n, "quarantined": n, "bytes": n}`` deleted (``progress``: a bar of the files, see
    :mod:`epochcache.cache.progress`). Raises :class:`DaemonRunningError` while a daemon (or verify
    --fix / gc) holds the lock, :class:`CacheError` while a trainer's lease is live."""
    layout = existing_layout(config)
    with exclusive(layout.lock, purpose="epochcache clear"):
        _refuse_live_leases(layout)
        shards, shard_bytes = _empty(layout.shards, progress)
        quarantined, quarantined_bytes = _empty(layout.quarantine, progress)
        shutil.rmtree(layout.ledger)
        if layout.footers.exists():  # (absent where the daemon kept none)
            shutil.rmtree(layout.footers)
        CacheLayout.create(layout.root)
    return {"shards": shards, "quarantined": quarantined, "bytes": shard_bytes + quarantined_bytes}


def _refuse_live_leases(layout: CacheLayout) -> None:
    ledger = Ledger(layout.ledger)
    try:
        leases = ledger.leases.live()
    finally:
        ledger.close()
    if leases:
        owners = ", ".join(sorted({str(lease["owner"]) for lease in leases}))
        raise CacheError(f"epochcache clear: {len(leases)} live lease(s) on {str(layout.root)!r} (owners: {owners}): "
                         "stop the training processes first (a killed trainer's lease expires after "
                         "loader.lease_ttl_s)")


def _empty(folder: Path, progress: bool | None) -> tuple[int, int]:
    """Delete every file in ``folder``; ``(files, bytes)`` deleted. One ``stat`` and one ``unlink`` per
    file (the listing's entry types say which are files); the names alone are kept for the bar's
    total (a DirEntry each would hold 1 KB per shard)."""
    with os.scandir(folder) as listing:
        paths = [entry.path for entry in listing if entry.is_file(follow_symlinks=False)]
    nbytes = 0
    with progress_bar(f"deleting {folder.name}", len(paths), progress, unit=" files") as bar:
        for path in paths:
            nbytes += os.lstat(path).st_size
            os.unlink(path)
            bar.update()
    return len(paths), nbytes
