"""A ranged read into place (RemoteFiles.fetch_into) over a loopback S3 server: exactly the bytes
asked for, or an error: never a body that is longer or shorter than its range."""

from __future__ import annotations

from typing import Any

import pytest
import s3fs

from epochcache.sources.remote import RemoteFiles, blank_image
from epochcache.sources.retry import RangeMismatchError
from epochcache.sources.scan import scan

DATA = bytes(range(256)) * 4096  # 1 MiB: several of aiohttp's received chunks


@pytest.fixture
def remote(s3: s3fs.S3FileSystem, bucket: str, s3_options: dict[str, Any]) -> RemoteFiles:
    s3.pipe(f"{bucket}/reads/blob.bin", DATA)
    return RemoteFiles(f"s3://{bucket}/reads", s3_options)


@pytest.mark.parametrize("start, end", [(0, len(DATA)), (1000, 700_001), (len(DATA) - 5, len(DATA))])
def test_a_range_is_written_into_place_exactly(remote: RemoteFiles, start: int, end: int) -> None:
    ((obj,),) = scan(remote, [".bin"], "blob")
    image = blank_image(end - start + 16)
    view = memoryview(image)
    remote.fetch_into(obj, start, view[: end - start])
    assert view[: end - start] == DATA[start:end]
    assert view[end - start :] == bytes(16), "nothing written past the range"


def test_a_store_that_ignores_the_range_is_an_error_not_bytes_at_wrong_offsets(
    remote: RemoteFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = remote._s3._request  # type: ignore[union-attr]

    def unranged(*args: Any) -> dict[str, Any]:  # injection: the store sends the whole object
        return {k: v for k, v in request(*args).items() if k != "Range"}

    monkeypatch.setattr(remote._s3, "_request", unranged)
    ((obj,),) = scan(remote, [".bin"], "blob")
    out = memoryview(blank_image(1000))
    with pytest.raises(RangeMismatchError, match="ignored the Range and sent the whole object"):
        remote.fetch_into(obj, 5000, out)
