"""A long listing (a remote of millions of objects takes minutes) shows its progress in `epochcache
status` while it runs, and the row goes once it is done."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
from conftest import wait_for, write_parquet_dataset

import epochcache.sync.daemon as daemon_module
from epochcache import SyncDaemon
from epochcache.config import Config
from epochcache.sources import RemoteObject
from epochcache.tools.status import cache_status, format_status


def test_status_shows_a_listing_under_way_and_drops_it_once_done(
    tmp_path: Any, make_config: Callable[..., Config], monkeypatch: Any
) -> None:
    root = tmp_path / "remote"
    write_parquet_dataset(fsspec.filesystem("file"), str(root), 4, 32, 16)
    config = make_config(str(root), **{"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB"})
    first_page_out, rest = threading.Event(), threading.Event()
    open_source = daemon_module.open_source

    def open_slow_listing(*args: Any) -> Any:  # injection: a listing that stalls after its first page
        source = open_source(*args)
        scan = source.scan_objects

        def paged() -> Iterator[list[RemoteObject]]:
            objects = [obj for page in scan() for obj in page]
            yield objects[:3]
            first_page_out.set()
            rest.wait(30)
            yield objects[3:]

        monkeypatch.setattr(source, "scan_objects", paged)
        return source

    monkeypatch.setattr(daemon_module, "open_source", open_slow_listing)
    result: list[Any] = []
    daemon = threading.Thread(target=lambda: result.append(SyncDaemon(config, progress=False).run(once=True)))
    daemon.start()
    try:
        assert first_page_out.wait(30)
        shown = wait_for(lambda: next((line for line in format_status(cache_status(config)).splitlines()
                                       if line.startswith("listing")), None), timeout=30)
        assert f"3 objects so far under {root}" in shown
    finally:
        rest.set()
        daemon.join(60)
    assert result and result[0].units_published == 8
    status = cache_status(config)
    assert status["daemon_detail"]["listing"] is None
    assert not any(line.startswith("listing") for line in format_status(status).splitlines())
