"""Quirky S3 stores, through the fault proxy: replies of another range than asked, listings that spell
ETags otherwise than If-Match accepts, objects refused one by one, connections that stall. Each read
is the bytes asked for or an error naming the object; never another range's bytes, never a hang."""

from __future__ import annotations

import io
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow.parquet as pq
import pytest
from conftest import make_table, wait_for
from faultproxy import FaultProxy

from epochcache.errors import CorruptObjectError, ObjectDeniedError, ObjectMissingError, SourceError
from epochcache.sources import ObjectSource, ParquetSource
from epochcache.sources.base import RemoteObject
from epochcache.sources.remote import RemoteFiles, blank_image
from epochcache.sources.retry import RangeMismatchError, is_transient, single_attempt_options
from epochcache.sources.scan import scan

DATA = bytes(range(256)) * 64  # 16 KiB, no two neighbouring bytes equal: a shifted range reads differently


def _parquet(rows: int = 64, start: int = 0) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(make_table(rows, start), buffer, row_group_size=32)
    return buffer.getvalue()


def _options(url: str, proxy: FaultProxy, timeout_s: float = 10.0) -> dict[str, Any]:
    """The storage options the daemon would use (one attempt per request, ``timeout_s``), via ``proxy``."""
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
    return single_attempt_options(url, options, timeout_s)


def _blob(s3: Any, bucket: str, proxy: FaultProxy) -> tuple[RemoteFiles, RemoteObject]:
    s3.pipe(f"{bucket}/blob/data.bin", DATA)
    info = s3.info(f"{bucket}/blob/data.bin")
    remote = RemoteFiles(f"s3://{bucket}/blob", _options(f"s3://{bucket}/blob", proxy))
    return remote, RemoteObject(f"{bucket}/blob/data.bin", len(DATA), info["ETag"])


@pytest.mark.parametrize("into", [False, True], ids=["fetch", "fetch_into"])
def test_a_206_of_another_range_is_refused_not_taken_for_the_range_asked(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], into: bool
) -> None:
    """The store answers bytes 999-1998 to a request for 1000-1999: the same length, so only its
    Content-Range tells; they must not be handed on as bytes 1000-1999."""
    proxy = quirky(range_quirk="shift")
    remote, obj = _blob(s3, bucket, proxy)
    with pytest.raises(RangeMismatchError, match=r"data.bin: asked for bytes from 1000, .*'bytes 999-1998/16384'"):
        if into:
            remote.fetch_into(obj, 1000, memoryview(blank_image(1000)))
        else:
            remote.fetch(obj, 1000, 2000)
    assert proxy.faults["range"] == 1


def test_a_200_with_the_whole_object_to_a_ranged_get_is_refused(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    proxy = quirky(range_quirk="ignore")
    remote, obj = _blob(s3, bucket, proxy)
    with pytest.raises(RangeMismatchError, match="from 1000, the store ignored the Range and sent the whole object"):
        remote.fetch(obj, 1000, 2000)
    assert remote.fetch(obj, 0, len(DATA)) == DATA, "from byte 0 the whole object is the range asked"


@pytest.mark.parametrize("quirk", ["shift", "ignore"])
def test_parquet_row_groups_from_a_range_mangling_store_are_errors_never_rows(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], quirk: str
) -> None:
    proxy = quirky()
    s3.pipe(f"{bucket}/pq/part.parquet", _parquet())
    source = ParquetSource(f"s3://{bucket}/pq", storage_options=_options(f"s3://{bucket}/pq", proxy),
                           whole_object_bytes=0)  # (ranged reads: an object read whole asks for no range)
    (obj,) = source.list_objects()
    units = source.units(obj)  # the footer, read straight
    proxy.range_quirk = quirk
    for unit in units:
        with pytest.raises(RangeMismatchError, match="part.parquet: asked for bytes from"):
            source.read(unit)
    assert proxy.faults["range"] == len(units)


def _upper(etag: bytes) -> bytes:
    return etag.upper().replace(b"&QUOT;", b"&quot;")


@pytest.mark.parametrize("respell", [_upper, lambda etag: b"W/" + etag], ids=["upper case", "weak"])
def test_listing_etags_spelled_otherwise_are_read_and_still_pinned(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture,
    respell: Callable[[bytes], bytes]
) -> None:
    """The listing spells ETags so that the store's If-Match refuses them (412) for unchanged objects:
    a HEAD shows them unchanged, the source reads on without If-Match (one warning), and an object
    rewritten after that is still refused by the reply's ETag, never read as the listed version."""
    proxy = quirky(listing_etag=respell)
    for name in ("a", "b"):
        s3.pipe(f"{bucket}/spell/part-{name}.parquet", _parquet(64, 100 if name == "b" else 0))
    source = ParquetSource(f"s3://{bucket}/spell", storage_options=_options(f"s3://{bucket}/spell", proxy))
    first, second = source.list_objects()
    with caplog.at_level(logging.WARNING, logger="epochcache.sources.remote"):
        ids = [i for unit in source.units(first) for i in source.read(unit).column("id").to_pylist()]
    assert ids == list(range(64))
    assert len([r for r in caplog.records if "refuses If-Match" in r.message]) == 1
    units = source.units(second)
    proxy.rewrite_on_get(f"/{bucket}/spell/part-b.parquet",
                         lambda: s3.pipe(f"{bucket}/spell/part-b.parquet", _parquet(64, 500)))
    with pytest.raises(ObjectMissingError, match="part-b.parquet changed since it was listed"):
        source.read(units[0])
    assert proxy.faults["rewrite"] == 1


def test_one_refused_object_is_object_denied_and_the_others_read(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    proxy = quirky(deny=[f"/{bucket}/deny/cls/b.bin"])
    for name in ("a", "b", "c"):
        s3.pipe(f"{bucket}/deny/cls/{name}.bin", name.encode() * 100)
    source = ObjectSource(f"s3://{bucket}/deny", storage_options=_options(f"s3://{bucket}/deny", proxy))
    a, b, c = source.list_objects()
    assert source.read(source.units(a)[0])["data"].to_pylist() == [b"a" * 100]
    with pytest.raises(ObjectDeniedError, match=r"cannot read s3://.*/deny/cls/b.bin: .*Access Denied.*skipped"):
        source.read(source.units(b)[0])
    assert source.read(source.units(c)[0])["data"].to_pylist() == [b"c" * 100]


@pytest.mark.parametrize(("options", "said"), [
    ({}, r"s3:GetObject"),
    ({"deny_status": 307, "deny_code": "TemporaryRedirect", "redirect": True},
     r"redirects it \(HTTP 307 to http://127.0.0.1:\d+/.*/nope/cls/2.bin\).*client_kwargs.endpoint_url"),
], ids=["forbidden", "redirected"])
def test_objects_refused_before_any_read_are_a_configuration_error(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], options: dict[str, Any], said: str
) -> None:
    """A policy that lets the bucket be listed but no object read, or a store that redirects every
    read: a few refusals with no read between them stop the source with a SourceError naming the
    URL and the fix, not a pass of skips."""
    names = [f"{bucket}/nope/cls/{i}.bin" for i in range(4)]
    proxy = quirky(deny=[f"/{name}" for name in names], **options)
    for name in names:
        s3.pipe(name, b"x" * 10)
    source = ObjectSource(f"s3://{bucket}/nope", storage_options=_options(f"s3://{bucket}/nope", proxy))
    objects = source.list_objects()
    for obj in objects[:2]:
        with pytest.raises(ObjectDeniedError):
            source.read(source.units(obj)[0])
    with pytest.raises(SourceError, match=rf"3 object\(s\) of s3://.*/nope refused, none read.*{said}") as info:
        source.read(source.units(objects[2])[0])
    assert not isinstance(info.value, ObjectDeniedError)


@pytest.mark.parametrize(("status", "code"), [(403, "InvalidAccessKeyId"), (400, "AuthorizationHeaderMalformed"),
                                              (403, "RequestTimeTooSkewed")])
def test_refused_credentials_signing_or_clock_are_a_configuration_error_at_once(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], status: int, code: str
) -> None:
    """A refused key, a region or signature the store does not take (400), a clock off by minutes: no
    object will read, so the first refusal stops the source, naming what to check."""
    proxy = quirky(deny=[f"/{bucket}/creds/cls/a.bin"], deny_status=status, deny_code=code)
    s3.pipe(f"{bucket}/creds/cls/a.bin", b"x" * 10)
    source = ObjectSource(f"s3://{bucket}/creds", storage_options=_options(f"s3://{bucket}/creds", proxy))
    (obj,) = source.list_objects()
    with pytest.raises(SourceError, match="check the credentials .* region and signature settings") as info:
        source.read(source.units(obj)[0])
    assert not isinstance(info.value, ObjectDeniedError)


def test_a_stalled_body_is_given_up_after_the_request_timeout(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    """Headers and half the body, then silence: the read fails within the timeout (a silence bound,
    botocore's read_timeout, which the daemon sets from sampler.request_timeout_s), naming the object."""
    proxy = quirky()
    s3.pipe(f"{bucket}/stall/part.parquet", _parquet())
    url = f"s3://{bucket}/stall"
    source = ParquetSource(url, storage_options=_options(url, proxy, timeout_s=0.5))
    (obj,) = source.list_objects()
    units = source.units(obj)
    proxy.rate, proxy.kinds = 1.0, ("stall",)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"part.parquet: request given up: silent for 0.5 s"):
        source.read(units[0])
    assert time.monotonic() - began < 8.0
    assert proxy.faults["stall"] == 1


@pytest.mark.slow  # (1.5 s of trickle)
def test_a_body_that_trickles_is_given_up_after_its_size_allows(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    """64 bytes every 0.2 s: never silent for the 0.5 s timeout, and 32 KiB would take 100 s. The read
    is given up once over twice the timeout plus its size at 64 KiB/s (about 1.5 s here), naming it."""
    proxy = quirky(drip_s=0.2)
    s3.pipe(f"{bucket}/drip/blob.bin", DATA * 2)
    url = f"s3://{bucket}/drip"
    remote = RemoteFiles(url, _options(url, proxy, timeout_s=0.5))
    obj = RemoteObject(f"{bucket}/drip/blob.bin", len(DATA) * 2, s3.info(f"{bucket}/drip/blob.bin")["ETag"])
    proxy.rate, proxy.kinds = 1.0, ("drip",)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"drip/blob.bin: request given up: .*under 64 KiB/s on average"):
        remote.fetch_into(obj, 0, memoryview(blank_image(obj.size)))
    assert time.monotonic() - began < 20.0, "given up in seconds, not after the whole trickle"
    assert proxy.faults["drip"] == 1


def test_a_stalled_listing_is_given_up_as_transient(s3: Any, bucket: str, quirky: Callable[..., FaultProxy]) -> None:
    """A listing's reply is read whole by botocore: its silence bound raises ReadTimeoutError naming
    the endpoint, which the retrier retries (and the daemon, after its attempts, retries after a pause)."""
    proxy = quirky(kinds=("stall",))
    s3.pipe(f"{bucket}/list/part.parquet", _parquet())
    url = f"s3://{bucket}/list"
    proxy.rate = 1.0
    began = time.monotonic()
    with pytest.raises(Exception, match=r"Read timeout on endpoint URL") as info:
        ParquetSource(url, storage_options=_options(url, proxy, timeout_s=0.5)).list_objects()
    assert is_transient(info.value) and time.monotonic() - began < 8.0
    assert proxy.faults["stall"] == 1


@pytest.mark.parametrize("throttle", [(429, "TooManyRequests"), (503, "SlowDownRead"), (502, "BadGateway")],
                         ids=["429", "minio-slowdownread", "502"])
def test_throttling_and_gateway_errors_by_any_name_are_transient(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], throttle: tuple[int, str]
) -> None:
    """s3fs has no errno for these (OSError EIO, the reply kept as its cause): still retried."""
    proxy = quirky(throttle=throttle)
    remote, obj = _blob(s3, bucket, proxy)
    proxy.rate, proxy.kinds = 1.0, ("503",)
    with pytest.raises(OSError) as caught:
        remote.fetch(obj, 0, 100)
    assert is_transient(caught.value), caught.value
    proxy.rate = 0.0
    assert remote.fetch(obj, 0, 100) == DATA[:100]


_REDIRECTED = r"redirects it \(HTTP {status} to http://127.0.0.1:\d+/.*/refuse/cls/b.bin\)"


@pytest.mark.parametrize(("status", "code", "fix"), [
    (400, "InvalidRequest", r"refuses to serve it \(HTTP 400\)"),
    (501, "NotImplemented", r"refuses to serve it \(HTTP 501\)"),
    (307, "TemporaryRedirect", _REDIRECTED.format(status=307)),
    (301, "PermanentRedirect", _REDIRECTED.format(status=301)),
], ids=["400", "501", "307", "301"])
def test_an_object_the_store_will_not_serve_is_object_denied_not_a_crash(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], status: int, code: str, fix: str
) -> None:
    """An SSE-C object read without its key (400), a feature the store lacks (501), a GET redirected
    elsewhere (Location: the object at the store behind the proxy; aiohttp followed it signed for the
    proxy, and the store's refusal read as a permission error): no retry cures it, so that object is
    skipped and reported, saying why, and the others read."""
    proxy = quirky(deny=[f"/{bucket}/refuse/cls/b.bin"], deny_status=status, deny_code=code, redirect=status < 400)
    for name in ("a", "b"):
        s3.pipe(f"{bucket}/refuse/cls/{name}.bin", name.encode() * 100)
    source = ObjectSource(f"s3://{bucket}/refuse", storage_options=_options(f"s3://{bucket}/refuse", proxy))
    a, b = source.list_objects()
    assert source.read(source.units(a)[0])["data"].to_pylist() == [b"a" * 100]
    with pytest.raises(ObjectDeniedError, match=rf"b.bin: .*skipped; the store {fix}") as caught:
        source.read(source.units(b)[0])
    assert not is_transient(caught.value)
    assert source.read(source.units(a)[0])["data"].to_pylist() == [b"a" * 100], "and the source reads on"
    assert proxy.faults["deny"] == 2, "b asked with checksums, then without: refused both times"
    assert b"x-amz-checksum-mode: enabled" in proxy.object_get_heads[-1].lower(), "a's checksum is still asked for"


def test_a_listing_the_store_refuses_is_a_configuration_error_naming_what_to_check(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    proxy = quirky(refuse_listing=(400, "InvalidArgument"))
    s3.pipe(f"{bucket}/nolist/cls/a.bin", b"x" * 10)
    source = ObjectSource(f"s3://{bucket}/nolist", storage_options=_options(f"s3://{bucket}/nolist", proxy))
    with pytest.raises(SourceError, match=r"cannot list s3://.*/nolist: .*endpoint, region and signature"):
        source.list_objects()


def test_a_range_past_the_end_of_an_object_cut_shorter_is_object_missing(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    """A store without If-Match answers 416 to a range an object, rewritten shorter since its
    listing, no longer holds: the object changed, not a crash."""
    proxy = quirky(ignore_if_match=True)
    remote, obj = _blob(s3, bucket, proxy)
    s3.pipe(obj.path, DATA[:1000])
    with pytest.raises(ObjectMissingError, match="changed since it was listed .*416"):
        remote.fetch(obj, 2000, 3000)


def test_checksums_are_asked_for_whole_objects_only_and_a_store_without_them_is_read_on(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A ranged GET asks for no checksum (stores that send the whole object's with a range would fail
    every ranged read); a whole-object GET does, and a store that answers that with 501 is read on
    without it, said once."""
    proxy = quirky(refuse_checksum_mode=True)
    remote, obj = _blob(s3, bucket, proxy)
    assert remote.fetch(obj, 100, 200) == DATA[100:200]
    assert b"x-amz-checksum-mode" not in proxy.object_get_heads[-1].lower()
    with caplog.at_level(logging.WARNING, logger="epochcache.sources.remote"):
        assert remote.fetch_whole(obj) == DATA
        assert remote.fetch_whole(obj) == DATA
    assert proxy.faults["checksum-mode"] == 1, "asked once, refused once, then not asked again"
    assert sum("refuses to send checksums" in r.getMessage() for r in caplog.records) == 1
    asked = [b"x-amz-checksum-mode: enabled" in head.lower() for head in proxy.object_get_heads]
    assert asked == [False, True, False, False], "the range, the refused whole GET, then two without"


@pytest.mark.parametrize("if_match", [True, False], ids=["if-match", "store-ignores-if-match"])
def test_reads_of_an_object_listed_without_an_etag_are_pinned_to_its_first_reply(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], if_match: bool
) -> None:
    """A store whose listing names no ETag: the first read's ETag pins the reads after it (a footer
    and the units read by it), so an object rewritten between them is changed, never read mixed."""
    proxy = quirky(ignore_if_match=not if_match)
    remote, listed = _blob(s3, bucket, proxy)
    obj = RemoteObject(listed.path, listed.size, None)
    assert remote.fetch(obj, 0, 100) == DATA[:100]
    s3.pipe(obj.path, DATA[::-1])  # rewritten, the same size
    with pytest.raises(ObjectMissingError, match="changed since it was listed"):
        remote.fetch(obj, 100, 200)


def _no_listed_etags(body: bytes) -> bytes:
    return re.sub(rb"<ETag>[^<]*</ETag>", b"", body)


def _listed(s3: Any, bucket: str, proxy: FaultProxy) -> tuple[RemoteFiles, RemoteObject]:
    """The blob of :func:`_blob`, as a listing through ``proxy`` names it."""
    s3.pipe(f"{bucket}/blob/data.bin", DATA)
    remote = RemoteFiles(f"s3://{bucket}/blob", _options(f"s3://{bucket}/blob", proxy))
    return remote, _listing(remote)


def _listing(remote: RemoteFiles) -> RemoteObject:
    ((obj,),) = scan(remote, [".bin"], "blob")
    return obj


def _next_second(s3: Any, path: str) -> None:
    """Wait until the clock is past the second ``path`` was last written in: a write now changes its
    Last-Modified (in whole seconds)."""
    written = s3.info(path)["LastModified"].timestamp()
    wait_for(lambda: time.time() >= int(written) + 1, timeout=5)


@pytest.mark.parametrize("listing_has_etags", [False, True], ids=["listed-without-etags", "if-match-ignored"])
def test_replies_without_an_etag_are_pinned_by_their_last_modified(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], listing_has_etags: bool
) -> None:
    """A store whose replies carry no ETag, and whose listing names none or which ignores If-Match: reads
    of one listed version are pinned by Last-Modified (the first reply's, and the listing's where it has
    no ETag), so an object rewritten between two of its reads (or, listed without ETags, after its
    listing) is changed, never read from another version."""
    proxy = quirky(reply_etag=lambda etag: b"", ignore_if_match=listing_has_etags,
                   listing_body=None if listing_has_etags else _no_listed_etags)
    remote, obj = _listed(s3, bucket, proxy)
    assert obj.etag is not None and obj.etag.startswith("modified:") != listing_has_etags
    assert remote.fetch(obj, 0, 100) == DATA[:100]
    _next_second(s3, obj.path)
    s3.pipe(obj.path, DATA[::-1])  # rewritten, the same size
    with pytest.raises(ObjectMissingError, match="changed since it was listed"):
        remote.fetch(obj, 100, 200)
    if not listing_has_etags:  # (no first reply to compare with: the listing's LastModified)
        with pytest.raises(ObjectMissingError, match="changed since it was listed"):
            RemoteFiles(remote.url, _options(remote.url, proxy)).fetch(obj, 0, 100)
    assert remote.fetch(_listing(remote), 100, 200) == DATA[::-1][100:200], "the next listing's version reads"


def test_an_object_listed_without_an_etag_and_rewritten_is_read_in_the_next_pass(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    """Reads pinned to a first reply's ETag are pinned per listed version (its LastModified): the next
    listing of a rewritten object reads its new version, rather than asking for the old one for ever."""
    proxy = quirky(listing_body=_no_listed_etags)
    remote, obj = _listed(s3, bucket, proxy)
    assert remote.fetch(obj, 0, 100) == DATA[:100]
    _next_second(s3, obj.path)
    s3.pipe(obj.path, DATA[::-1])
    relisted = _listing(remote)
    assert relisted.etag != obj.etag
    assert remote.fetch(relisted, 0, 100) == DATA[::-1][:100]


def test_a_store_whose_gets_and_listings_name_versions_apart_is_read_pinned_to_its_first_replies(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A store whose GETs and HEADs name other ETags than its listing, and whose If-Match takes only
    theirs: an unchanged object is read (once a listing shows it unchanged, the listing's ETags are given
    up, with a warning, and each object's reads are pinned to its first reply's ETag), never skipped
    as changed pass after pass; one rewritten after that is still changed."""
    proxy = quirky(etags_apart=True)
    remote, obj = _listed(s3, bucket, proxy)
    with caplog.at_level(logging.WARNING, logger="epochcache.sources.remote"):
        assert remote.fetch(obj, 0, 100) == DATA[:100]
        assert remote.fetch(obj, 100, 200) == DATA[100:200]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "name versions apart" in messages[0], messages
    s3.pipe(obj.path, DATA[::-1])  # rewritten, the same size
    with pytest.raises(ObjectMissingError, match="changed since it was listed"):
        remote.fetch(obj, 200, 300)


def _strip_tokens(body: bytes) -> bytes:
    return re.sub(rb"<NextContinuationToken>[^<]*</NextContinuationToken>", b"", body)


def _fresh_tokens() -> Callable[[bytes], bytes]:
    """A listing rewrite giving every truncated page a continuation token never given before."""
    counter = itertools.count()
    return lambda body: re.sub(rb"(?<=<NextContinuationToken>)[^<]*", lambda m: b"fresh%d" % next(counter), body)


def _paged(s3: Any, bucket: str, proxy: FaultProxy, name: str, objects: int = 7) -> Iterator[list[str]]:
    """The pages of paths ``scan`` lists, 3 keys a page through ``proxy``, under ``objects`` new ones."""
    for i in range(objects):
        s3.pipe(f"{bucket}/{name}/k{i}.bin", b"x")
    remote = RemoteFiles(f"s3://{bucket}/{name}", _options(f"s3://{bucket}/{name}", proxy))
    return ([obj.path for obj in page] for page in scan(remote, [".bin"], "blob", page_size=3))


@pytest.mark.parametrize("quirk", [{"listing_body": _strip_tokens}, {"listing_ignores": ("list-type",)}],
                         ids=["no-token", "v1-only"])
def test_a_truncated_listing_page_without_a_continuation_token_is_listed_on_by_v1_after_its_last_key(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture, quirk: dict[str, Any]
) -> None:
    """Some stores leave NextContinuationToken out of a truncated page, and a store that knows only
    ListObjects V1 answers V2 with a V1 page (s3fs's own pager then fails with a KeyError): the
    listing goes on by V1 from the page's last key, every object once, in order."""
    proxy = quirky(**quirk)
    with caplog.at_level(logging.WARNING):
        listed = [path for page in _paged(s3, bucket, proxy, "notoken") for path in page]
    assert listed == [f"{bucket}/notoken/k{i}.bin" for i in range(7)]
    assert proxy.listings == 3
    assert "without a continuation token" in caplog.text


@pytest.mark.parametrize("tokens", ["same", "fresh", "none"])
def test_a_store_that_answers_the_first_page_again_is_a_source_error_not_an_endless_listing(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], tokens: str
) -> None:
    """Whatever token it gives (its first again, a new one each time, none), a store that ignores
    how a listing continues fails at its second page, before any object is listed twice."""
    body = {"same": None, "fresh": _fresh_tokens(), "none": _strip_tokens}[tokens]
    proxy = quirky(listing_ignores=("continuation-token", "start-after", "marker"), listing_body=body)
    listed: list[str] = []
    remote_pages = _paged(s3, bucket, proxy, "again")
    with pytest.raises(SourceError, match=r"/again: page 2 of the listing is truncated but gives no key after those "
                                          r"listed before it, so the listing does not advance"):
        for page in remote_pages:
            listed += page
    assert listed == [f"{bucket}/again/k{i}.bin" for i in range(3)]
    assert proxy.listings == 2
    assert proxy.faults["listing-ignored"] == 1


def _entry(name: bytes, field: bytes, value: bytes | None) -> Callable[[bytes], bytes]:
    """A listing rewrite giving key ``name``'s ``field`` another value (None: no such field)."""
    def rewrite(body: bytes) -> bytes:
        replacement = b"" if value is None else rb"<%s>%s</%s>" % (field, value, field)
        pattern = rb"(<Key>[^<]*/%s</Key>(?:(?!</Contents>).)*?)<%s>[^<]*</%s>" % (re.escape(name), field, field)
        return re.sub(pattern, lambda m: m.group(1) + replacement, body, flags=re.S)
    return rewrite


def _damaged(body: bytes) -> bytes:
    """k1, k2 and k4 listed with sizes that are no byte counts, k3 with a LastModified that is no
    date, and IsTruncated spelled as no S3 does."""
    for rewrite in (_entry(b"k1.bin", b"Size", b"-533"), _entry(b"k2.bin", b"Size", b"1e3"),
                    _entry(b"k4.bin", b"Size", None), _entry(b"k3.bin", b"LastModified", b"not-a-date")):
        body = rewrite(body)
    return body.replace(b"<IsTruncated>true</IsTruncated>", b"<IsTruncated>True</IsTruncated>")


def test_listing_entries_botocore_cannot_read_are_left_out_with_a_warning_and_the_listing_goes_on(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged listing entry (a size that is negative, not an integer, missing) is never read with a
    nonsense range, nor fails its whole page in botocore (every restart again): it is left out, one
    warning per page names it; a LastModified that is no date leaves the entry listed; a page whose
    IsTruncated reads ``True`` is truncated (botocore reads only ``true``: the listing would end there)."""
    proxy = quirky(listing_body=_damaged)
    with caplog.at_level(logging.WARNING, logger="epochcache.sources.scan"):
        listed = [path for page in _paged(s3, bucket, proxy, "sizes") for path in page]
    assert listed == [f"{bucket}/sizes/k{i}.bin" for i in (0, 3, 5, 6)]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "left out 2 listed object(s) whose key or size is missing or bad" in warnings[0]
    assert "sizes/k1.bin (size '-533')" in warnings[0] and "sizes/k4.bin (size None)" in warnings[1]


def _outside(body: bytes) -> bytes:
    """A key of another prefix, in order, on the listing's first page (a store that ignores the prefix)."""
    if b"<ContinuationToken>" in body or b"<Marker>" in body:  # (pages after the first echo what they were asked)
        return body
    return body.replace(b"<Key>", b"<Key>aaa/x.bin</Key><Size>1</Size></Contents><Contents><Key>", 1)


def _twice(body: bytes) -> bytes:
    """Each key's entry twice (the page that follows starts at the last key again: an inclusive token)."""
    return re.sub(rb"<Contents>.*?</Contents>", lambda m: m.group(0) * 2, body, flags=re.S)


@pytest.mark.parametrize("rewrite", [_outside, _twice], ids=["outside-the-prefix", "each-key-twice"])
def test_each_key_under_the_prefix_is_listed_once_whatever_the_store_repeats_or_adds(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture,
    rewrite: Callable[[bytes], bytes]
) -> None:
    proxy = quirky(listing_body=rewrite)
    with caplog.at_level(logging.WARNING, logger="epochcache.sources.scan"):
        listed = [path for page in _paged(s3, bucket, proxy, "once") for path in page]
    assert listed == [f"{bucket}/once/k{i}.bin" for i in range(7)]
    assert ("outside the prefix 'once/'" in caplog.text) == (rewrite is _outside)


@pytest.mark.parametrize("ignore_if_match", [False, True], ids=["if-match", "store-ignores-if-match"])
def test_more_bytes_of_the_listed_version_than_the_listing_says_are_a_corrupt_object_not_a_change(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], ignore_if_match: bool
) -> None:
    """A listing that gives an object fewer bytes than its listed version holds (the reply's ETag is
    the listed one) would say the same at every pass: the object is skipped as corrupt, with the
    reason, not dropped as changed pass after pass without a report."""
    proxy = quirky(ignore_if_match=ignore_if_match)
    remote, listed = _listed(s3, bucket, proxy)
    understated = RemoteObject(listed.path, listed.size - 7, listed.etag)
    with pytest.raises(CorruptObjectError, match=f"serves more than the {len(DATA) - 7} bytes its listing gives"):
        remote.fetch_whole(understated)
    s3.pipe(listed.path, DATA + b"grown")  # rewritten: now a change, as before
    with pytest.raises(ObjectMissingError, match="changed since it was listed"):
        remote.fetch_whole(listed)


def test_a_v1_listing_goes_on_past_a_page_whose_every_entry_is_left_out(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A store that knows only ListObjects V1 continues from a key: a page whose entries are all left
    out (sizes that are no byte counts) still moves the listing on from its last key."""
    def damaged(body: bytes) -> bytes:
        for name in (b"k3.bin", b"k4.bin", b"k5.bin"):
            body = _entry(name, b"Size", b"x")(body)
        return _strip_tokens(body)

    proxy = quirky(listing_body=damaged)
    with caplog.at_level(logging.WARNING, logger="epochcache.sources.scan"):
        listed = [path for page in _paged(s3, bucket, proxy, "v1bad") for path in page]
    assert listed == [f"{bucket}/v1bad/k{i}.bin" for i in (0, 1, 2, 6)]
    assert "left out 3 listed object(s) whose key or size is missing or bad" in caplog.text
    assert "(size 'x')" in caplog.text
