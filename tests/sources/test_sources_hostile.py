"""Hostile objects, one format failure each: every one is a one-line CorruptObjectError naming the
object, never a traceback from deep in pyarrow or tarfile, never a huge allocation, never wrong rows.
Also the Retrier's handling of CorruptObjectError, pinned reads and configuration errors."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import io
import logging
import re
import resource
import tarfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from botocore.compat import HAS_CRT
from conftest import make_table
from faultproxy import FaultProxy

from epochcache.errors import CorruptObjectError, FetchFailedError, ObjectMissingError, SourceError
from epochcache.sources import ArrowSource, ObjectSource, ParquetSource, WebDatasetSource
from epochcache.sources.retry import Retrier, single_attempt_options


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


GOOD_TAR = _tar([(f"s/{i:03d}.{field}", bytes([i]) * 600) for i in range(4) for field in ("a", "b")])


def _read_tar(tmp_path: Path, data: bytes, max_sample_bytes: int = 2**20) -> pa.Table:
    path = tmp_path / "remote" / "shard.tar"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    source = WebDatasetSource(str(path.parent), max_sample_bytes=max_sample_bytes)
    (obj,) = source.list_objects()
    return source.read(source.units(obj)[0])


def _sparse_tar(declared: int) -> bytes:
    """A GNU sparse member declaring ``declared`` bytes of which none are stored (one empty region)."""
    header = bytearray(tarfile.TarInfo("s/000.a").tobuf(tarfile.GNU_FORMAT))
    header[156] = ord("S")  # typeflag GNUTYPE_SPARSE
    # realsize (offset 483, 12 octal bytes) and one sparse entry (offset 386: offset 0, numbytes 0)
    header[483:495] = f"{declared:011o}\0".encode()
    header[386:398] = b"00000000000\0"
    header[398:410] = b"00000000000\0"
    header[148:156] = b"        "
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    return bytes(header) + b"\0" * 10240


def test_a_good_tar_reads(tmp_path: Path) -> None:
    table = _read_tar(tmp_path, GOOD_TAR)
    assert table.num_rows == 4 and table.column("a").to_pylist()[2] == bytes([2]) * 600


@pytest.mark.parametrize("damage", ["truncated", "bad-checksum", "garbage-tail"])
def test_a_damaged_tar_is_corrupt_not_fewer_rows(tmp_path: Path, damage: str) -> None:
    data = bytearray(GOOD_TAR)
    second = 512 + 1024  # header of the second member: after the first header and its 600 bytes padded
    if damage == "truncated":
        data = data[: second + 512 + 100]
    elif damage == "bad-checksum":
        data[second + 10] ^= 0x20  # a name byte: the header checksum no longer matches
    else:
        data = data[: len(GOOD_TAR) - 10240] + b"x" * 10240  # no end-of-archive zero blocks
    with pytest.raises(CorruptObjectError, match="shard.tar"):
        _read_tar(tmp_path, bytes(data))


def test_a_member_over_max_sample_bytes_is_corrupt(tmp_path: Path) -> None:
    with pytest.raises(CorruptObjectError, match="over sampler.max_sample_bytes=500"):
        _read_tar(tmp_path, GOOD_TAR, max_sample_bytes=500)


def test_a_sparse_tar_declaring_a_gib_allocates_nothing(tmp_path: Path) -> None:
    data = _sparse_tar(2**30)
    assert len(data) < 12_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptObjectError, match="sparse"):
        _read_tar(tmp_path, data)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 100_000, f"peak RSS grew by {grown_kib} KiB reading a 10 KB tar"


def test_an_object_over_max_sample_bytes_is_corrupt_unfetched(tmp_path: Path) -> None:
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "big.bin").write_bytes(b"x" * 1000)
    source = ObjectSource(str(tmp_path), max_sample_bytes=999)
    (obj,) = source.list_objects()
    with pytest.raises(CorruptObjectError, match="big.bin is 1000 bytes, over sampler.max_sample_bytes=999"):
        source.read(source.units(obj)[0])


def _parquet(path: Path, checksums: bool = True) -> bytes:
    pq.write_table(make_table(64), path, row_group_size=32, compression="snappy", write_page_checksum=checksums)
    return path.read_bytes()


def test_a_corrupt_parquet_page_is_corrupt_object_naming_the_unit(tmp_path: Path) -> None:
    path = tmp_path / "part.parquet"
    data = bytearray(_parquet(path))
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data[chunk.data_page_offset + chunk.total_compressed_size // 2] ^= 0xFF
    path.write_bytes(data)
    source = ParquetSource(str(path))
    (obj,) = source.list_objects()
    units = source.units(obj)
    with pytest.raises(CorruptObjectError, match=r"part.parquet row group 1 \(.*#1\)") as info:
        source.read(units[1])
    assert "\n" not in str(info.value)


def test_page_crcs_catch_a_flip_snappy_does_not(tmp_path: Path) -> None:
    """A flipped byte in an uncompressed page decodes to wrong values without page CRCs; with them
    (page_checksum_verification) the read is refused."""
    path = tmp_path / "part.parquet"
    pq.write_table(make_table(64), path, row_group_size=64, compression="none", write_page_checksum=True)
    data = bytearray(path.read_bytes())
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(1)  # the int64 ids
    data[chunk.data_page_offset + chunk.total_compressed_size - 8] ^= 0x01
    path.write_bytes(data)
    source = ParquetSource(str(path))
    (obj,) = source.list_objects()
    with pytest.raises(CorruptObjectError, match="part.parquet"):
        source.read(source.units(obj)[0])


def test_a_damaged_arrow_batch_is_corrupt_object(tmp_path: Path) -> None:
    path = tmp_path / "part.arrow"
    table = pa.table({"name": pa.array([f"row-{i}" for i in range(100)])})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table)
    data = bytearray(path.read_bytes())
    data[400:480] = b"\xff" * 80  # inside the batch: its offsets now point far outside the data
    path.write_bytes(data)
    source = ArrowSource(str(path))
    (obj,) = source.list_objects()
    (unit,) = source.units(obj)
    with pytest.raises(CorruptObjectError, match="part.arrow: record batch 0"):
        source.read(unit)


def test_the_retrier_retries_corrupt_objects_then_reraises_the_last() -> None:
    counts: dict[str, int] = {}
    calls: list[int] = []

    def read() -> Any:
        calls.append(1)
        raise CorruptObjectError(f"bad bytes, attempt {len(calls)}")

    retrier = Retrier(3, 0.0, 0.0, lambda name: counts.__setitem__(name, counts.get(name, 0) + 1))
    with pytest.raises(CorruptObjectError, match="attempt 3"):
        retrier.call(read, what="x")
    assert len(calls) == 3 and counts == {"retries": 2, "give_ups": 1}


def test_a_corrupt_object_that_heals_on_retry_is_read() -> None:
    calls: list[int] = []

    def read() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise CorruptObjectError("flipped in transit")
        return "rows"

    assert Retrier(3, 0.0, 0.0, lambda name: None).call(read, what="x") == "rows"
    with pytest.raises(FetchFailedError):
        Retrier(2, 0.0, 0.0, lambda name: None).call(_reset, what="x")


def _reset() -> None:
    raise ConnectionResetError("reset by peer")


def test_a_local_object_rewritten_after_listing_is_never_cut(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(GOOD_TAR)
    source = WebDatasetSource(str(tmp_path))
    (obj,) = source.list_objects()
    path.write_bytes(_tar([("s/000.a", b"new" * 5000)]))
    with pytest.raises(ObjectMissingError, match="changed since it was listed"):
        source.read(source.units(obj)[0])


def _s3_source(cls: type, s3: Any, bucket: str, s3_options: dict[str, Any], name: str, data: bytes) -> Any:
    s3.pipe(f"{bucket}/pin/{name}", data)
    return cls(f"s3://{bucket}/pin", storage_options=s3_options)


@pytest.mark.parametrize("cls, name", [(ParquetSource, "part.parquet"), (WebDatasetSource, "shard.tar")])
def test_an_s3_object_rewritten_after_listing_is_never_cut(
    tmp_path: Path, s3: Any, bucket: str, s3_options: dict[str, Any], cls: type, name: str
) -> None:
    """The listing's ETag pins every read (If-Match): the rewritten, larger object is not read up to
    its stale size, whether ranged (Parquet) or whole (tar)."""
    original = _parquet(tmp_path / "a.parquet") if cls is ParquetSource else GOOD_TAR
    source = _s3_source(cls, s3, bucket, s3_options, name, original)
    (obj,) = source.list_objects()
    assert obj.etag and obj.size == len(original)
    units = source.units(obj)
    s3.pipe(f"{bucket}/pin/{name}", original + original)
    with pytest.raises(ObjectMissingError, match=f"{name} changed since it was listed"):
        source.read(units[0])
    (again,) = cls(f"s3://{bucket}/pin", storage_options=s3_options).list_objects()
    assert again.size == 2 * len(original) and again.etag != obj.etag, "the next pass's listing sees it"


def test_a_read_is_pinned_to_the_listed_etag(s3: Any, bucket: str, s3_options: dict[str, Any]) -> None:
    source = _s3_source(WebDatasetSource, s3, bucket, s3_options, "shard.tar", GOOD_TAR)
    (obj,) = source.list_objects()
    assert source.read(source.units(obj)[0]).num_rows == 4
    # a listing that saw another version of the same size: the read refuses today's bytes
    lying = type(obj)(obj.path, obj.size, '"' + "0" * 32 + '"')
    with pytest.raises(ObjectMissingError, match="ETag no longer matches"):
        source.read(source.units(lying)[0])


def test_no_credentials_is_one_line_source_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_endpoint: str
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    source = ParquetSource("s3://some-bucket/data", storage_options={"client_kwargs": {"endpoint_url": s3_endpoint}})
    with pytest.raises(SourceError, match=r"cannot list s3://some-bucket/data: NoCredentialsError.*give credentials"):
        source.list_objects()


def test_no_such_bucket_is_source_error(s3_options: dict[str, Any]) -> None:
    source = ParquetSource("s3://no-such-bucket-here/data", storage_options=s3_options)
    with pytest.raises(SourceError, match="cannot list s3://no-such-bucket-here/data"):
        source.list_objects()


@pytest.mark.slow  # (1.5 s)
def test_every_request_sent_is_counted(s3: Any, bucket: str, s3_endpoint: str) -> None:
    """Through the proxy, half the requests are throttled or cut short after their headers: each request
    the proxy saw is a success, a counted retry or a counted give-up (botocore's and s3fs's own
    retries are off; aiohttp's one re-send is only for a connection closed before any reply)."""

    s3.pipe(f"{bucket}/count/a.bin", b"x" * 1000)
    proxy = FaultProxy(s3_endpoint, rate=0.5, kinds=("503", "truncate"), seed=1)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
        source = ObjectSource(f"s3://{bucket}/count", storage_options=single_attempt_options(
            f"s3://{bucket}/count", options, 10.0))
        counts: dict[str, int] = {"retries": 0, "give_ups": 0}
        retrier = Retrier(4, 0.0, 0.0, lambda name: counts.__setitem__(name, counts[name] + 1))
        (obj,) = retrier.call(source.list_objects, what="listing")
        proxy.requests, counts["retries"], counts["give_ups"] = 0, 0, 0
        done = 0
        for _ in range(20):
            try:
                retrier.call(source._remote.fetch, obj, 0, 100, what="a.bin")
                done += 1
            except FetchFailedError:
                pass
        assert proxy.faults["503"] > 3 and proxy.faults["truncate"] > 3
        assert proxy.requests == done + counts["retries"] + counts["give_ups"]
    finally:
        proxy.close()


def test_parquet_reads_run_on_the_calling_thread_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pyarrow pool thread reads our Python file object (one still in it at interpreter exit
    aborts the process: exit 134); the whole decode happens on the caller's thread."""
    from epochcache.sources import parquet

    threads: set[int] = set()
    inner = parquet._buffered

    def spying(*args: Any) -> Any:
        f = inner(*args)
        read = f.read

        def recording(*a: Any) -> bytes:
            threads.add(threading.get_ident())
            return read(*a)

        f.read = recording  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(parquet, "_buffered", spying)
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.table({f"c{i}": list(range(1000)) for i in range(16)}), path, row_group_size=500)
    source = ParquetSource(str(path))
    (obj,) = source.list_objects()
    for unit in source.units(obj):
        assert source.read(unit).num_rows == 500
    assert threads == {threading.get_ident()}


def test_a_flipped_whole_object_is_corrupt_by_the_store_checksum(s3: Any, bucket: str, s3_endpoint: str) -> None:
    """Every GET body flipped: the unranged, If-Match-pinned GET of a whole object gets the store's
    x-amz-checksum, which botocore checks; the mismatch is a one-line CorruptObjectError."""

    s3.pipe(f"{bucket}/flip/cls/a.bin", b"x" * 1000)
    proxy = FaultProxy(s3_endpoint, rate=0.0, flip_rate=1.0, seed=2)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
        source = ObjectSource(f"s3://{bucket}/flip", storage_options=options)
        (obj,) = source.list_objects()
        with pytest.raises(CorruptObjectError, match="a.bin: the store's checksum does not match"):
            source.read(source.units(obj)[0])
        assert proxy.faults["flip"] == 1
    finally:
        proxy.close()


def _crc(data: bytes, width: int, reflected_poly: int) -> bytes:
    """A reflected CRC of ``data`` (initial value and final xor all ones), big-endian, as S3 sends it
    (computed here, so that a test can give a store's checksum without awscrt)."""
    mask = (1 << width) - 1
    crc = mask
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (reflected_poly if crc & 1 else 0)
    return (crc ^ mask).to_bytes(width // 8, "big")


_CRCS = {"CRC64NVME": functools.partial(_crc, width=64, reflected_poly=0x9A6C9329AC4BC9B5),
         "CRC32C": functools.partial(_crc, width=32, reflected_poly=0x82F63B78),
         "CRC32": functools.partial(_crc, width=32, reflected_poly=0xEDB88320)}


def test_the_crcs_the_proxy_sends_are_the_standard_ones() -> None:
    assert _CRCS["CRC64NVME"](b"123456789").hex() == "ae8b14860a799888"
    assert _CRCS["CRC32C"](b"123456789").hex() == "e3069283"
    assert _CRCS["CRC32"](b"123456789").hex() == "cbf43926"


_SSE_KMS = {"x-amz-server-side-encryption": "aws:kms"}  # (its ETag is then no MD5 of the body)


def _composite(body: bytes, algorithm: str, parts: int) -> str:
    """S3's composite checksum of ``body`` uploaded in ``parts`` parts of one size but the last: the
    checksum of the parts' checksums, ``<base64>-<parts>``."""
    part = -(-len(body) // parts)
    joined = b"".join(_CRCS[algorithm](body[at:at + part]) for at in range(0, len(body), part))
    return base64.b64encode(_CRCS[algorithm](joined)).decode() + f"-{parts}"


@contextlib.contextmanager
def _crt_only_store(s3: Any, bucket: str, s3_endpoint: str, algorithm: str, flip_rate: float,
                    parts: int | None = None) -> Iterator[ObjectSource]:
    """An object source over one object encrypted with SSE-KMS (its ETag no MD5) whose only checksum
    is ``algorithm`` (with ``parts``, a multipart upload's composite checksum of that many parts),
    through a proxy flipping a bit of each body at ``flip_rate``."""

    s3.pipe(f"{bucket}/crt/cls/a.bin", b"x" * 1000)
    header = f"x-amz-checksum-{algorithm.lower()}"

    def headers(body: bytes) -> dict[str, str]:
        value = base64.b64encode(_CRCS[algorithm](body)).decode() if parts is None else \
            _composite(body, algorithm, parts)
        return {header: value, **_SSE_KMS}

    proxy = FaultProxy(s3_endpoint, rate=0.0, flip_rate=flip_rate, seed=2, ignore_if_match=True,
                       reply_headers=headers)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url},
                   "config_kwargs": {"response_checksum_validation": "when_required"}}  # (as the daemon sets it)
        yield ObjectSource(f"s3://{bucket}/crt", storage_options=options)
        assert re.findall(rb"(?im)^x-amz-checksum-[a-z0-9]+:", proxy.object_get_replies[-1]) == [f"{header}:".encode()]
    finally:
        proxy.close()


@pytest.mark.skipif(not HAS_CRT, reason="needs awscrt (the crt extra)")
@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C"])
def test_a_flipped_whole_object_is_corrupt_by_a_checksum_only_awscrt_computes(
    s3: Any, bucket: str, s3_endpoint: str, algorithm: str
) -> None:
    """S3 gives new objects a CRC64NVME checksum; SDKs may upload with CRC32C. botocore checks them
    with awscrt installed, which catches a flipped body the ETag of a multipart (or SSE-KMS) object
    cannot (without awscrt it was read as the object's bytes)."""
    with _crt_only_store(s3, bucket, s3_endpoint, algorithm, flip_rate=1.0) as source:
        (obj,) = source.list_objects()
        with pytest.raises(CorruptObjectError, match="a.bin: the store's checksum does not match"):
            source.read(source.units(obj)[0])


@pytest.mark.skipif(HAS_CRT, reason="awscrt is installed: botocore checks these checksums")
@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C"])
def test_a_whole_object_whose_only_checksum_botocore_cannot_check_is_said_so_once(
    s3: Any, bucket: str, s3_endpoint: str, algorithm: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _crt_only_store(s3, bucket, s3_endpoint, algorithm, flip_rate=0.0) as source:
        (obj,) = source.list_objects()
        with caplog.at_level(logging.WARNING, logger="epochcache.sources.remote"):
            for _ in range(2):
                assert source.read(source.units(obj)[0])["data"].to_pylist() == [b"x" * 1000]
    said = [r.message for r in caplog.records if "read unchecked" in r.message]
    assert len(said) == 1 and algorithm in said[0] and "epochcache[crt]" in said[0]


@pytest.mark.skipif(HAS_CRT, reason="awscrt is installed: epochcache checks composite CRC32Cs")
def test_a_whole_object_whose_only_checksum_is_a_composite_crc32c_is_said_read_unchecked_once(
    s3: Any, bucket: str, s3_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A multipart upload's checksum is of its parts' checksums (``<base64>-<parts>``): botocore skips
    it, and without awscrt epochcache has no CRC32C to compute it with: said once, not read as checked."""
    with _crt_only_store(s3, bucket, s3_endpoint, "CRC32C", flip_rate=0.0, parts=3) as source:
        (obj,) = source.list_objects()
        with caplog.at_level(logging.WARNING, logger="epochcache.sources.remote"):
            for _ in range(2):
                assert source.read(source.units(obj)[0])["data"].to_pylist() == [b"x" * 1000]
    said = [r.message for r in caplog.records if "read unchecked" in r.message]
    assert len(said) == 1 and "CRC32C of its parts" in said[0] and "composite" in said[0]


@pytest.mark.parametrize("flip_rate", [0.0, 1.0], ids=["intact", "flipped"])
def test_a_whole_object_is_checked_by_its_composite_crc32(
    s3: Any, bucket: str, s3_endpoint: str, flip_rate: float, caplog: pytest.LogCaptureFixture
) -> None:
    """botocore never checks a composite checksum; epochcache does, cutting the body into the parts
    (here the even split of 1,000 bytes into 3): intact, read without a word; flipped, corrupt."""
    with _crt_only_store(s3, bucket, s3_endpoint, "CRC32", flip_rate=flip_rate, parts=3) as source:
        (obj,) = source.list_objects()
        with caplog.at_level(logging.WARNING):
            if flip_rate:
                with pytest.raises(CorruptObjectError, match=r"a.bin: its bytes do not match its composite CRC32 "):
                    source.read(source.units(obj)[0])
            else:
                assert source.read(source.units(obj)[0])["data"].to_pylist() == [b"x" * 1000]
        assert not caplog.records


@pytest.mark.parametrize("spelling", [None, bytes.upper, lambda etag: b"W/" + etag],
                         ids=["as-sent", "upper-case", "weak"])
def test_a_flipped_whole_object_is_corrupt_by_its_md5_etag(
    s3: Any, bucket: str, s3_endpoint: str, spelling: Callable[[bytes], bytes] | None
) -> None:
    """From a store that sends no checksum (it refuses ``x-amz-checksum-mode``), the plain-MD5 ETag
    still catches the flipped body, whether the store spells it in upper case or marks it weak."""

    s3.pipe(f"{bucket}/md5/cls/a.bin", b"x" * 1000)
    proxy = FaultProxy(s3_endpoint, rate=0.0, flip_rate=1.0, seed=2, refuse_checksum_mode=True, reply_etag=spelling)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url},
                   "config_kwargs": {"response_checksum_validation": "when_required"}}  # (as the daemon sets it)
        source = ObjectSource(f"s3://{bucket}/md5", storage_options=options)
        (obj,) = source.list_objects()
        with pytest.raises(CorruptObjectError, match=r"a.bin: its bytes do not match its ETag \(MD5"):
            source.read(source.units(obj)[0])
    finally:
        proxy.close()


_NO_FLEXIBLE_CHECKS = {"response_checksum_validation": "when_required"}  # (the ETag is then the check)


def test_a_store_whose_etags_are_not_md5s_is_read_and_said_so(
    s3: Any, bucket: str, s3_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two reads that agree with each other but not with a plain-looking ETag, for three objects and
    no ETag ever matched: the store's ETags are not MD5s. The first two objects are corrupt until
    then (each may be damaged at rest: skipped, it is read again at the pass end), the third's bytes
    are kept, the source stops checking ETags, and one warning says so."""
    names = "abc"
    for name in names:
        s3.pipe(f"{bucket}/notmd5/cls/{name}.bin", name.encode() * 1000)
    proxy = FaultProxy(s3_endpoint, rate=0.0, disguise_etags=True, refuse_checksum_mode=True)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url},
                   "config_kwargs": _NO_FLEXIBLE_CHECKS}
        source = ObjectSource(f"s3://{bucket}/notmd5", storage_options=options)
        objects = source.list_objects()
        assert objects[0].etag is not None and hashlib.md5(b"a" * 1000).hexdigest() not in objects[0].etag
        with caplog.at_level(logging.WARNING):
            for obj in objects[:2]:
                with pytest.raises(CorruptObjectError, match="damaged at rest, or the store's ETags are not what"):
                    source.read(source.units(obj)[0])
            before = proxy.object_gets
            for obj, name in ((objects[2], "c"), (objects[0], "a")):  # (a's read at the pass end)
                assert source.read(source.units(obj)[0])["data"].to_pylist() == [name.encode() * 1000]
        assert proxy.object_gets - before == 3, "two reads of c, then one of a"
        said = [r.message for r in caplog.records if "are not MD5s" in r.message]
        assert len(said) == 1 and "c.bin" in said[0]
    finally:
        proxy.close()


def test_an_object_whose_bytes_at_rest_no_longer_match_its_md5_is_corrupt_once_others_matched(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """Bit rot at rest: two reads of b agree, not with its ETag (MD5), which a and c match. b is
    corrupt, named so, and the source's ETag checks go on (no store-wide give-up)."""
    bodies = {name: name.encode() * 1000 for name in "abc"}
    for name, body in bodies.items():
        s3.pipe(f"{bucket}/rot/{name}.bin", body)
    stored = hashlib.md5(bodies["b"]).hexdigest().encode()
    uploaded = hashlib.md5(b"b before it rotted").hexdigest().encode()
    # (and no x-amz-checksum-*, which botocore would check and find the bytes to match: the store's
    # checksum is of what it holds)
    proxy = quirky(ignore_if_match=True, listing_etag=lambda etag: etag.replace(stored, uploaded),
                   reply_etag=lambda etag: etag.replace(stored, uploaded), refuse_checksum_mode=True)
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url},
               "config_kwargs": _NO_FLEXIBLE_CHECKS}
    source = ObjectSource(f"s3://{bucket}/rot", storage_options=options)
    a, b, c = source.list_objects()
    with caplog.at_level(logging.WARNING, logger="epochcache.sources.remote"):
        assert source.read(source.units(a)[0])["data"].to_pylist() == [bodies["a"]]
        for _ in range(2):  # (and again: still corrupt, never given up)
            with pytest.raises(CorruptObjectError, match=f"rot/b.bin: two reads agree, not with its ETag \\(MD5\\) "
                                                         f"\"{uploaded.decode()}\", which other objects under "
                                                         ".* match: damaged at rest"):
                source.read(source.units(b)[0])
        assert source.read(source.units(c)[0])["data"].to_pylist() == [bodies["c"]]
    assert not [r for r in caplog.records if "not MD5s" in r.message]


@pytest.mark.parametrize("store", ["honours If-Match", "ignores If-Match"])
@pytest.mark.parametrize("whole", [False, True], ids=["ranged", "whole"])
def test_an_object_rewritten_just_before_its_get_is_skipped_not_cut(
    tmp_path: Path, s3: Any, bucket: str, s3_endpoint: str, store: str, whole: bool
) -> None:
    """The proxy rewrites the object (twice as long) between the footer read and a row group's GET
    (ranged reads), or the GET of the whole object (a small one, read whole), as a racing writer
    would: the pinned GET answers 412 or, from a store that ignores If-Match, the new version, whose
    ETag the reply names; either way the unit is skipped for this pass."""

    original = _parquet(tmp_path / "a.parquet")
    s3.pipe(f"{bucket}/race/part.parquet", original)
    proxy = FaultProxy(s3_endpoint, rate=0.0, ignore_if_match=store == "ignores If-Match")
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
        source = ParquetSource(f"s3://{bucket}/race", storage_options=options,
                               whole_object_bytes=len(original) if whole else 0)
        (obj,) = source.list_objects()
        units = source.units(obj)
        if not whole:
            assert source.read(units[0]).num_rows == 32
        proxy.rewrite_on_get(f"/{bucket}/race/part.parquet", lambda: s3.pipe(f"{bucket}/race/part.parquet",
                                                                               original + original))
        with pytest.raises(ObjectMissingError, match="changed since it was listed"):
            source.read(units[1])
        assert proxy.faults["rewrite"] == 1 and s3.size(f"{bucket}/race/part.parquet") == 2 * len(original)
    finally:
        proxy.close()


def test_a_whole_object_botocore_checked_by_its_full_object_checksum_is_not_judged_by_its_etag(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """An ETag that is no MD5 (SSE-KMS without the header that says so) on a reply whose
    x-amz-checksum-* botocore checked: the bytes are the store's, read once, never called damaged."""
    for name in "ab":
        s3.pipe(f"{bucket}/kms/{name}.bin", name.encode() * 1000)
    stored = hashlib.md5(b"b" * 1000).hexdigest().encode()
    opaque = hashlib.md5(b"a KMS data key").hexdigest().encode()
    proxy = quirky(ignore_if_match=True, listing_etag=lambda etag: etag.replace(stored, opaque),
                   reply_etag=lambda etag: etag.replace(stored, opaque))
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
    source = ObjectSource(f"s3://{bucket}/kms", storage_options=options)
    a, b = source.list_objects()
    with caplog.at_level(logging.WARNING):
        for obj, name in ((a, "a"), (b, "b")):
            assert source.read(source.units(obj)[0])["data"].to_pylist() == [name.encode() * 1000]
    assert proxy.object_gets == 2 and not caplog.records
    assert b"x-amz-checksum-crc" in proxy.object_get_replies[-1].lower(), "the store sent a checksum botocore checks"
