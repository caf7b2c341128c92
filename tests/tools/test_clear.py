"""epochcache.tools.clear: empty a cache on purpose, never under a running daemon or a live lease."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from epochcache import SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.lockfile import exclusive
from epochcache.config import Config
from epochcache.errors import CacheError, DaemonRunningError
from epochcache.sources.base import RemoteObject
from epochcache.sources.footers import FooterStore
from epochcache.tools.clear import clear_cache


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_file()]


def test_clear_deletes_shards_quarantine_and_ledger_then_a_daemon_refills(
    synced_cache: Callable[..., Config],
) -> None:
    config = synced_cache(3, 64, 32, "64KiB")
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    shards = ledger.shards()
    ledger.quarantine.add(shards[0].id, "test")
    ledger.daemon.set_identity({"sources": ["old"]})
    ledger.close()
    (layout.shards / shards[0].filename).rename(layout.quarantine / shards[0].filename)  # as a reader does
    footers = FooterStore(layout.footers, 2**20)  # as a daemon reading a remote over a network keeps them
    footers.put("Parquet", RemoteObject("bucket/a.parquet", 100, '"1"'), b"footer")
    footers.close()

    done = clear_cache(config)
    assert done["shards"] == len(shards) - 1 and done["quarantined"] == 1 and done["bytes"] > 0
    assert _files(layout.shards) == [] and _files(layout.quarantine) == [] and not layout.footers.exists()
    ledger = Ledger(layout.ledger)
    state = ledger.daemon
    assert (ledger.shards(), state.identity(), state.cursor(), state.skipped()) == ([], None, None, {})
    ledger.close()
    SyncDaemon(config, progress=False).run(once=True)
    ledger = Ledger(layout.ledger)
    assert sum(r.rows for r in ledger.shards()) == 3 * 64
    ledger.close()


def test_clear_is_refused_while_a_daemon_holds_the_lock(synced_cache: Callable[..., Config]) -> None:
    config = synced_cache(1, 64, 32, "64KiB")
    layout = CacheLayout(Path(config.cache.dir))
    with exclusive(layout.lock), pytest.raises(DaemonRunningError, match="epochcache clear"):
        clear_cache(config)
    assert _files(layout.shards), "nothing deleted"


def test_clear_is_refused_while_a_trainer_holds_a_lease(synced_cache: Callable[..., Config]) -> None:
    config = synced_cache(1, 64, 32, "64KiB")
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    ledger.leases.snapshot("host:7:epoch0", ttl_s=60)
    ledger.close()
    with pytest.raises(CacheError, match=r"1 live lease\(s\).*host:7:epoch0"):
        clear_cache(config)
    assert _files(layout.shards), "nothing deleted"


def test_clear_of_a_missing_cache_creates_nothing(make_config: Callable[..., Config]) -> None:
    config = make_config("remote")
    with pytest.raises(CacheError, match="does not exist"):
        clear_cache(config)
    assert not Path(config.cache.dir).exists()


def test_clear_shows_its_progress_when_asked(
    synced_cache: Callable[..., Config], capsys: pytest.CaptureFixture[str]
) -> None:
    config = synced_cache(3, 64, 32, "64KiB")
    shards = len(_files(CacheLayout(Path(config.cache.dir)).shards))
    capsys.readouterr()
    assert clear_cache(config, progress=True)["shards"] == shards
    assert "deleting shards: 100%" in capsys.readouterr().err
