"""ObjectSource: one sample per object, labels from the parent folder or a sidecar table."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pytest
from conftest import UnitLog
from faultproxy import FaultProxy

from epochcache.config import SourceConfig
from epochcache.errors import CorruptObjectError, ObjectMissingError, SourceError
from epochcache.sources import KEY_COLUMN, open_source

IMAGES = {"cat/1.jpg": b"meow-1", "cat/2.jpg": b"meow-2", "dog/1.jpg": b"woof-1"}


@pytest.fixture(params=["local", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, str, str, dict[str, Any]]:
    """(filesystem, root, url, storage_options) of an ImageFolder-style tree."""
    if request.param == "local":
        fs, root, options = fsspec.filesystem("file"), str(tmp_path / "imgs"), {}
        url = root
    else:
        fs, bucket, options = (request.getfixturevalue(n) for n in ("s3", "bucket", "s3_options"))
        root, url = f"{bucket}/imgs", f"s3://{bucket}/imgs"
    for name, data in IMAGES.items():
        fs.makedirs(f"{root}/{name.split('/')[0]}", exist_ok=True)
        fs.pipe(f"{root}/{name}", data)
    return fs, root, url, options


def test_labels_from_the_parent_folder(remote: tuple[Any, str, str, dict[str, Any]]) -> None:
    fs, root, url, options = remote
    source = open_source(SourceConfig(url=url, format="objects", labels="folder", storage_options=options))
    objects = source.list_objects()
    assert [o.path.removeprefix(root).lstrip("/") for o in objects] == sorted(IMAGES)
    rows = [source.read(source.units(obj)[0]).to_pylist()[0] for obj in objects]
    assert [(r["data"], r["label"], r["label_name"]) for r in rows] == [
        (b"meow-1", 0, "cat"), (b"meow-2", 0, "cat"), (b"woof-1", 1, "dog")]
    assert rows[2][KEY_COLUMN] == f"{objects[2].path}:0"
    assert source.classes() == ["cat", "dog"]  # type: ignore[attr-defined]
    table = source.read(source.units(objects[0])[0])
    assert table.schema.field("label").type == pa.int32()
    assert json.loads(table.schema.field("label").metadata[b"classes"]) == ["cat", "dog"]


def test_folder_markers_are_not_samples(s3: Any, bucket: str, s3_options: dict[str, Any]) -> None:
    """Zero-byte keys ending in "/", as the S3 console makes for folders, are left out of listings."""
    for name, data in {"m/cat/": b"", "m/cat/1.jpg": b"meow", "m/dog/": b"", "m/dog/1.jpg": b"woof"}.items():
        s3.pipe(f"{bucket}/{name}", data)
    source = open_source(SourceConfig(url=f"s3://{bucket}/m", format="objects", labels="folder",
                                      storage_options=s3_options))
    assert [o.path for o in source.list_objects()] == [f"{bucket}/m/cat/1.jpg", f"{bucket}/m/dog/1.jpg"]
    assert source.classes() == ["cat", "dog"]  # type: ignore[attr-defined]


def test_folder_labels_refuse_an_object_outside_the_class_folders(
    remote: tuple[Any, str, str, dict[str, Any]]
) -> None:
    fs, root, url, options = remote
    source = open_source(SourceConfig(url=url, format="objects", labels="folder", storage_options=options))
    assert source.classes() == ["cat", "dog"]  # type: ignore[attr-defined]
    fs.makedirs(f"{root}/emu", exist_ok=True)
    fs.pipe(f"{root}/emu/1.jpg", b"new class after the list was taken")
    fs.pipe(f"{root}/loose.jpg", b"no class folder")
    for obj in source.list_objects():
        if obj.path.endswith(("emu/1.jpg", "loose.jpg")):
            with pytest.raises(CorruptObjectError, match="lies in no class folder"):
                source.read(source.units(obj)[0])


def test_labels_from_a_sidecar_table_which_is_not_a_sample(remote: tuple[Any, str, str, dict[str, Any]]) -> None:
    fs, root, url, options = remote
    lines = [{"key": "cat/1.jpg", "label": 0, "caption": "a cat"}, {"key": "dog/1.jpg", "label": 1, "caption": "a dog"}]
    fs.pipe(f"{root}/labels.jsonl", "\n".join(json.dumps(line) for line in lines).encode())
    sidecar = f"{url}/labels.jsonl"
    source = open_source(SourceConfig(url=url, format="objects", labels=sidecar, storage_options=options))
    objects = source.list_objects()
    assert len(objects) == len(IMAGES), "the sidecar is not listed as a sample"
    rows = {o.path.rsplit("imgs/", 1)[1]: source.read(source.units(o)[0]).to_pylist()[0] for o in objects}
    assert rows["dog/1.jpg"]["label"] == 1 and rows["dog/1.jpg"]["caption"] == "a dog"
    assert rows["cat/2.jpg"]["label"] is None, "an object without a row gets nulls"


def test_bad_sidecars_and_missing_objects(remote: tuple[Any, str, str, dict[str, Any]]) -> None:
    fs, root, url, options = remote
    with pytest.raises(SourceError, match="labels.txt"):
        open_source(SourceConfig(url=url, format="objects", labels=f"{url}/labels.txt", storage_options=options))
    fs.pipe(f"{root}/nokey.csv", b"name,label\ncat/1.jpg,0\n")
    with pytest.raises(SourceError, match="no 'key' column"):
        open_source(SourceConfig(url=url, format="objects", labels=f"{url}/nokey.csv", storage_options=options))
    source = open_source(SourceConfig(url=url, format="objects", storage_options=options))
    obj = next(o for o in source.list_objects() if o.path.endswith("dog/1.jpg"))
    fs.rm(obj.path)
    with pytest.raises(ObjectMissingError, match="dog/1.jpg"):
        source.read(source.units(obj)[0])


def test_labels_only_with_format_objects(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="applies only to format 'objects'"):
        SourceConfig(url=str(tmp_path), labels="folder")


def test_the_daemon_caches_one_sample_per_object(tmp_path: Path, make_config: Any) -> None:
    for name, data in IMAGES.items():
        (tmp_path / "imgs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "imgs" / name).write_bytes(data)
    log = UnitLog()
    config = make_config(str(tmp_path / "imgs"), **{"source.format": "objects", "source.labels": "folder",
                                                   "cache.max_bytes": "10MB", "cache.shard_bytes": "64KiB"})
    report = log.daemon(config).run(once=True)
    assert report.samples_published == len(IMAGES) and len(set(log.published)) == len(IMAGES)


def test_a_store_that_ignores_the_prefix_never_makes_a_class_of_a_folder_outside_the_url(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy]
) -> None:
    """Its listing of the URL's folders is of the bucket's: a folder beside the URL (``ant/``) must not
    become class 0 and shift every label; the source's own folders are all it takes."""
    for name, data in {"ant/1.jpg": b"x", **{f"imgs/{k}": v for k, v in IMAGES.items()}}.items():
        s3.pipe(f"{bucket}/{name}", data)
    proxy = quirky(listing_ignores=("prefix",))
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
    source = open_source(SourceConfig(url=f"s3://{bucket}/imgs", format="objects", labels="folder",
                                      storage_options=options))
    assert "ant" not in source.classes()  # type: ignore[attr-defined]
