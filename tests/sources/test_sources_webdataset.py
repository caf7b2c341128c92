"""WebDatasetSource: tar members grouped by key into samples, one GET per tar, local and on S3."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import UnitLog

from epochcache.config import SourceConfig
from epochcache.errors import CorruptObjectError, ObjectMissingError
from epochcache.sources import KEY_COLUMN, open_source

SHARDS, SAMPLES = 3, 5


def _tar(shard: int, fields: tuple[str, ...] = ("cls", "jpg")) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for sample in range(SAMPLES):
            for field in fields:
                payload = f"{shard}/{sample}/{field}".encode()
                info = tarfile.TarInfo(f"images/s{shard:02d}_{sample:03d}.{field}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


@pytest.fixture(params=["local", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, str, str, dict[str, Any]]:
    """(filesystem, root, url, storage_options) of a folder of SHARDS tar shards."""
    if request.param == "local":
        fs, root, options = fsspec.filesystem("file"), str(tmp_path / "wds"), {}
        url = root
    else:
        fs, bucket, options = (request.getfixturevalue(n) for n in ("s3", "bucket", "s3_options"))
        root = f"{bucket}/wds"
        url = f"s3://{root}"
    fs.makedirs(root, exist_ok=True)
    for shard in range(SHARDS):
        fs.pipe(f"{root}/shard-{shard:04d}.tar", _tar(shard))
    return fs, root, url, options


def test_members_are_grouped_into_samples_with_stable_keys(remote: tuple[Any, str, str, dict[str, Any]]) -> None:
    fs, root, url, options = remote
    source = open_source(SourceConfig(url=url, format="webdataset", storage_options=options))
    objects = source.list_objects()
    assert len(objects) == SHARDS
    (unit,) = source.units(objects[1])
    table = source.read(unit)
    assert table.column_names == ["cls", "jpg", KEY_COLUMN]
    assert table.num_rows == SAMPLES
    assert table.column("jpg").to_pylist()[2] == b"1/2/jpg"
    assert table.column(KEY_COLUMN).to_pylist()[2] == f"{objects[1].path}:images/s01_002"
    assert source.read(unit).equals(table)


def test_one_get_per_tar_and_field_selection(
    remote: tuple[Any, str, str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, root, url, options = remote
    source = open_source(SourceConfig(url=url, format="webdataset", columns=["cls", "txt"], storage_options=options))
    obj = source.list_objects()[0]
    calls: list[tuple[int, int]] = []
    inner = source._remote._read  # type: ignore[attr-defined]
    monkeypatch.setattr(source._remote, "_read",  # type: ignore[attr-defined]
                        lambda o, start, end, whole: calls.append((start, end)) or inner(o, start, end, whole))
    table = source.read(source.units(obj)[0])
    assert calls == [(0, obj.size + 1)], "one GET of the whole tar, one byte past it to see growth"
    assert table.column_names == ["cls", "txt", KEY_COLUMN]
    assert table.column("txt").null_count == SAMPLES, "a field no sample has is a column of nulls"


def test_corrupt_and_missing_tars(remote: tuple[Any, str, str, dict[str, Any]]) -> None:
    fs, root, url, options = remote
    fs.pipe(f"{root}/zz-broken.tar", b"\x01" * 1024)
    source = open_source(SourceConfig(url=url, format="webdataset", storage_options=options))
    objects = source.list_objects()
    with pytest.raises(CorruptObjectError, match="zz-broken.tar"):
        source.read(source.units(objects[-1])[0])
    fs.rm(objects[0].path)
    with pytest.raises(ObjectMissingError, match="shard-0000.tar"):
        source.read(source.units(objects[0])[0])


def test_the_daemon_caches_a_webdataset(tmp_path: Path, make_config: Any) -> None:
    root = tmp_path / "wds"
    root.mkdir()
    for shard in range(SHARDS):
        (root / f"shard-{shard:04d}.tar").write_bytes(_tar(shard))
    log = UnitLog()
    config = make_config(str(root), **{"source.format": "webdataset", "source.columns": ["cls", "jpg"],
                                      "cache.max_bytes": "10MB", "cache.shard_bytes": "64KiB"})
    report = log.daemon(config).run(once=True)
    assert report.samples_published == SHARDS * SAMPLES
    assert sorted(log.published) == [f"{root}/shard-{n:04d}.tar#0" for n in range(SHARDS)]
