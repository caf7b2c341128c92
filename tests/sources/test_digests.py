"""Whole objects checked against their store's digests (epochcache.sources.digests): a multipart
upload's ETag (the MD5 of its parts' MD5s) and composite checksum, which botocore never checks, found
by the part sizes uploaders use; a flipped body is corrupt, an intact one read with one GET, and a
store whose parts cannot be guessed read with one warning."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
from conftest import upload_multipart
from faultproxy import FaultProxy

from epochcache.errors import CorruptObjectError
from epochcache.sources import ObjectSource
from epochcache.sources.digests import MAX_TRIES, MiB, WholeDigests, part_sizes


def _etag(body: bytes, part: int) -> str:
    """A multipart upload's ETag of ``body`` cut into parts of ``part`` bytes, computed here."""
    md5s = b"".join(hashlib.md5(body[at:at + part]).digest() for at in range(0, len(body), part))
    return f'"{hashlib.md5(md5s).hexdigest()}-{-(-len(body) // part)}"'


@pytest.mark.parametrize("size, parts", [(100 * MiB + 1, 13), (10 * MiB + 7, 2), (3 * MiB, 3), (999, 1), (1, 1)])
def test_every_part_size_tried_cuts_the_object_into_its_parts(size: int, parts: int) -> None:
    sizes = part_sizes(size, parts)
    assert sizes and len(sizes) <= MAX_TRIES
    assert all(-(-size // part) == parts for part in sizes)


def test_the_part_sizes_tried_start_with_the_last_that_matched_then_the_common_ones() -> None:
    assert part_sizes(100 * MiB + 1, 13)[0] == 8 * MiB, "the AWS CLI's and boto3's"
    assert part_sizes(120 * MiB, 3)[0] == 50 * MiB, "s3fs's"
    assert part_sizes(11 * MiB, 2, hint=7 * MiB)[0] == 7 * MiB
    assert 7 * MiB not in part_sizes(30 * MiB, 2, hint=7 * MiB), "a hint that gives another count is not tried"
    assert part_sizes(12, 0) == []
    assert 7 * MiB in part_sizes(14_807_040, 3), "s3fs's parts: the first 1 MiB write past a 6 MiB block"


@pytest.mark.parametrize("part", [8 * MiB, 5 * MiB, 16 * MiB, None], ids=["8MiB", "5MiB", "16MiB", "even-split"])
def test_a_multipart_etag_of_a_common_or_even_part_size_checks_the_bytes(part: int | None) -> None:
    body = bytes(range(256)) * ((2 * (part or 5 * MiB) + 1000) // 256)
    part = part or -(-len(body) // 3)
    reply = {"ETag": _etag(body, part)}
    assert WholeDigests().check(body, reply).checked
    damaged = bytearray(body)
    damaged[part + 17] ^= 1
    verdict = WholeDigests().check(bytes(damaged), reply)
    assert not verdict.checked and verdict.failed is not None and verdict.failed.kind == "multipart ETag"


def test_an_encrypted_objects_etag_is_not_taken_for_a_digest() -> None:
    body = b"x" * 1000
    assert WholeDigests().check(body, {"ETag": f'"{hashlib.md5(b"other").hexdigest()}"',
                                       "ServerSideEncryption": "aws:kms"}) == (False, None)


def _source(proxy: FaultProxy, bucket: str) -> ObjectSource:
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url},
               "config_kwargs": {"response_checksum_validation": "when_required"}}  # (as the daemon sets it)
    return ObjectSource(f"s3://{bucket}/mp", storage_options=options)


PARTS = [bytes([1]) * 5 * MiB, bytes([2]) * 5 * MiB, bytes([3]) * 1000]  # (S3's least part: 5 MiB)


def test_an_intact_multipart_object_is_read_with_one_get_and_no_warning(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    etag = upload_multipart(s3, f"{bucket}/mp/cls/big.bin", PARTS)
    assert etag.strip('"').endswith("-3") and etag == _etag(b"".join(PARTS), 5 * MiB)
    proxy = quirky()
    source = _source(proxy, bucket)
    (obj,) = source.list_objects()
    with caplog.at_level(logging.WARNING):
        assert source.read(source.units(obj)[0])["data"].to_pylist() == [b"".join(PARTS)]
    assert len(proxy.object_get_replies) == 1 and not caplog.records


def test_a_multipart_object_flipped_in_transit_is_corrupt_by_its_etag(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    """Its ETag is no MD5 of the body, and it carries no checksum botocore checks: before, a bit
    flipped in transit was read as the object's bytes (a WebDataset tar over plain HTTP)."""
    upload_multipart(s3, f"{bucket}/mp/cls/big.bin", PARTS)
    proxy = quirky(flip_rate=1.0, seed=3)
    source = _source(proxy, bucket)
    (obj,) = source.list_objects()
    with pytest.raises(CorruptObjectError, match=r"big.bin: its bytes do not match its multipart ETag .*-3"):
        source.read(source.units(obj)[0])
    assert proxy.faults["flip"] == 2, "read twice: damage does not repeat itself bit for bit"


def test_parts_of_sizes_not_guessed_are_read_once_three_objects_show_it_and_said_once(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """First parts larger than the second: no one part size gives the ETags. Two reads of an object
    agree, which may be damage at rest: the first two such objects are corrupt (read again at the
    pass end), the third shows the parts to be of sizes not guessed: the source stops checking
    multipart ETags (one warning), its bytes are taken, and the first is then read once."""
    odd = [[bytes([n]) * 6 * MiB, bytes([n + 1]) * 5 * MiB, bytes([n + 2]) * 1000] for n in (1, 4, 7)]
    for name, parts in zip("abc", odd):
        upload_multipart(s3, f"{bucket}/mp/cls/{name}.bin", parts)
    proxy = quirky()
    source = _source(proxy, bucket)
    a, b, c = source.list_objects()
    with caplog.at_level(logging.WARNING):
        for obj in (a, b):
            with pytest.raises(CorruptObjectError, match="damaged at rest, or uploaded in parts of sizes"):
                source.read(source.units(obj)[0])
        for obj, parts in ((c, odd[2]), (a, odd[0])):
            assert source.read(source.units(obj)[0])["data"].to_pylist() == [b"".join(parts)]
    assert len(proxy.object_get_replies) == 7, "two reads of each, then one"
    (said,) = [r.message for r in caplog.records]
    assert "c.bin: two reads agree but not with its multipart ETag" in said and "as for 3 objects" in said
    assert "sizes epochcache does not guess" in said
