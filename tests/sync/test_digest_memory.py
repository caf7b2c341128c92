"""The kinds of digest that matched a source's objects outlive the run (``epochcache.sync.digest_memory``):
a restarted daemon whose first whole reads are of objects damaged at rest still calls them damaged."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy

from epochcache import Ledger
from epochcache.config import SourceConfig
from epochcache.errors import CorruptObjectError
from epochcache.sources import ObjectSource
from epochcache.sync.digest_memory import LedgerDigests


def test_a_new_run_knows_the_stores_etags_matched_before(
    tmp_path: Path, s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    bodies = {name: name.encode() * 1000 for name in "abcd"}
    for name, body in bodies.items():
        s3.pipe(f"{bucket}/rot/{name}.bin", body)
    # b, c and d rotted at rest: their ETags are the MD5s of what was uploaded, not of what is stored
    rotten = {hashlib.md5(bodies[n]).hexdigest().encode(): hashlib.md5(n.encode()).hexdigest().encode() for n in "bcd"}

    def respell(etag: bytes) -> bytes:
        for stored, uploaded in rotten.items():
            etag = etag.replace(stored, uploaded)
        return etag

    proxy = quirky(ignore_if_match=True, listing_etag=respell, reply_etag=respell, refuse_checksum_mode=True)
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url},
               "config_kwargs": {"response_checksum_validation": "when_required"}}  # (asked for by us alone)
    url = f"s3://{bucket}/rot"
    config = SourceConfig(url=url, format="objects", storage_options=options)
    ledger = Ledger(tmp_path / "ledger")
    try:
        first = ObjectSource(url, storage_options=options, digests=LedgerDigests(ledger, config))
        a = first.list_objects()[0]
        assert first.read(first.units(a)[0])["data"].to_pylist() == [bodies["a"]]
        assert ledger.daemon.digests_matched(f"{url} at {proxy.url}") == ["ETag"]
        assert ledger.daemon.digests_matched(url) == [], "kept by URL and endpoint"

        restarted = ObjectSource(url, storage_options=options, digests=LedgerDigests(ledger, config))
        for obj in restarted.list_objects()[1:]:  # three of them: a store-wide give-up without the memory
            with pytest.raises(CorruptObjectError, match="which other objects under .* match: damaged at rest"):
                restarted.read(restarted.units(obj)[0])
    finally:
        ledger.close()
