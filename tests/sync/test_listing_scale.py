"""Listing at scale: 100,000 objects listed over HTTP (paginated, streamed) and sampled in bounded memory.

The objects are generated directly in the in-process moto server's backend (creating them over HTTP
would take minutes); the listing itself goes through s3fs over HTTP, one ListObjectsV2 page at a
time. Listing and sampling run in a child process, whose peak RSS growth is measured.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow.parquet as pq
import pytest
from conftest import make_table

RSS_GROWTH_LIMIT_MB = 48

_PROBE = r"""
import json, sys, tempfile
from epochcache.cache.ledger import Ledger
from epochcache.sync.listing import store_listing
from epochcache.sync.sampler import Cursor, Sampler
from epochcache.sources import ParquetSource

url, options, units_wanted = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
source = ParquetSource(url, storage_options=options)
def rss():  # peak RSS of this process in MB (VmHWM: unlike ru_maxrss, not inherited from the parent)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
with tempfile.TemporaryDirectory() as cache:
    ledger = Ledger(cache)
    warm = source.scan_objects()  # one page first: the S3 client and its service model load once
    next(warm)
    warm.close()
    before = rss()
    listing = store_listing(ledger, source.scan_objects(), {"pass": 0})
    sampler = Sampler(lambda objs: [source.units(o) for o in objs], listing, seed=0)
    walked = []
    for unit, _ in sampler.walk(Cursor()):
        walked.append(unit.key)
        if len(walked) == units_wanted:
            break
    rows = source.read(unit).num_rows
    print(json.dumps({"count": len(listing), "walked": len(set(walked)), "rows": rows,
                      "first": listing[0].path, "last": listing[len(listing) - 1].path,
                      "rss_before_mb": before, "rss_peak_mb": rss()}))
    ledger.close()
"""


@pytest.fixture(params=[pytest.param(10_000, id="10k", marks=pytest.mark.slow),
                        pytest.param(100_000, id="100k", marks=pytest.mark.soak)])
def big_bucket(request: pytest.FixtureRequest, s3_endpoint: str) -> Iterator[tuple[str, int]]:
    """A bucket of small Parquet files (2 row groups each), made in moto's backend. Both cases are
    scale tests, the 10k case slow, the 100k case soak: moto answers each ListObjectsV2 page in time
    linear in the bucket (the 100k case 90-120 s in all on 2 cores, the 10k case 3-8 s)."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    name = f"scale-{uuid.uuid4().hex[:12]}"
    backend.create_bucket(name, "us-east-1")
    buffer = io.BytesIO()
    pq.write_table(make_table(4), buffer, row_group_size=2)
    payload = buffer.getvalue()
    for number in range(request.param):
        backend.put_object(name, f"data/part-{number:06d}.parquet", payload)
    yield name, request.param
    backend.buckets[name].keys.clear()  # free the test process's memory at once
    backend.delete_bucket(name)


def test_a_large_prefix_is_listed_and_sampled_in_bounded_memory(
    big_bucket: tuple[str, int], s3_options: dict[str, Any]
) -> None:
    big_bucket, objects = big_bucket
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, f"s3://{big_bucket}/data", json.dumps(s3_options), "40"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    print("listing probe:", probe)
    assert probe["count"] == objects
    assert probe["first"].endswith("part-000000.parquet") and probe["last"].endswith(f"part-{objects - 1:06d}.parquet")
    assert probe["walked"] == 40 and probe["rows"] == 2
    assert probe["rss_peak_mb"] - probe["rss_before_mb"] < RSS_GROWTH_LIMIT_MB, probe
