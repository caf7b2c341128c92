"""Tests for epochcache.cache.shards: atomic Arrow IPC shard files, checksums and zero-copy reads."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import make_table

import epochcache.cache.shards as shards
from epochcache.cache.shards import (
    ShardMeta,
    encoded_size,
    file_checksum,
    open_shard,
    read_record_meta,
    verify_shard,
    with_record_meta,
    write_shard,
)
from epochcache.errors import ShardCorruptError


def write(table: pa.Table, folder: Path, name: str = "s1") -> tuple[Path, str]:
    """Write ``table`` as shard ``name`` under ``folder``; return its final path and checksum."""
    final = folder / f"{name}.arrow"
    checksum = write_shard(table, folder / f"{name}.arrow.tmp", final)
    return final, checksum


def test_round_trip(tmp_path: Path) -> None:
    table = make_table(1000, start=500)
    path, _ = write(table, tmp_path)
    back = open_shard(path)
    assert back.equals(table)
    assert back.schema == table.schema
    assert back.column("id").to_pylist() == list(range(500, 1500))


def test_single_record_batch(tmp_path: Path) -> None:
    # The daemon hands over a combined table (one chunk per column); the file holds one batch.
    table = pa.concat_tables([make_table(100), make_table(100, start=100), make_table(50, start=200)])
    path, _ = write(table.combine_chunks(), tmp_path)
    with pa.memory_map(str(path), "r") as source:
        assert pa.ipc.open_file(source).num_record_batches == 1
    back = open_shard(path)
    assert back.column("id").num_chunks == 1
    assert back.column("id").to_pylist() == list(range(250))


def test_empty_table_round_trip(tmp_path: Path) -> None:
    table = make_table(1).slice(0, 0)
    path, checksum = write(table, tmp_path)
    assert open_shard(path).num_rows == 0
    assert encoded_size(table) == path.stat().st_size
    verify_shard(path, checksum)


def test_no_tmp_file_left(tmp_path: Path) -> None:
    write(make_table(10), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1.arrow"]
    assert list(tmp_path.glob("*.tmp")) == []


def test_checksum_matches_final_file(tmp_path: Path) -> None:
    path, checksum = write(make_table(300), tmp_path)
    assert checksum == file_checksum(path)
    assert len(checksum) == 32  # XXH3-128, hex
    int(checksum, 16)
    verify_shard(path, checksum)  # does not raise


def test_checksum_differs_for_different_content(tmp_path: Path) -> None:
    _, a = write(make_table(300), tmp_path, "a")
    _, b = write(make_table(300, start=1), tmp_path, "b")
    assert a != b


@pytest.mark.parametrize("rows", [1, 17, 4096])
def test_encoded_size_is_exact(tmp_path: Path, rows: int) -> None:
    table = make_table(rows)
    path, _ = write(table, tmp_path)
    assert encoded_size(table) == path.stat().st_size


def test_open_shard_is_zero_copy(tmp_path: Path) -> None:
    table = make_table(8192)  # ~6 MiB of image bytes
    path, _ = write(table, tmp_path)
    assert path.stat().st_size > 4 * 2**20
    del table
    before = pa.total_allocated_bytes()
    back = open_shard(path)
    ids = back.column("id").to_numpy()
    images = back.column("image").chunk(0).to_numpy_ndarray()
    assert int(ids.sum()) == sum(range(8192))
    assert images.shape == (8192, 3, 16, 16)
    assert int(images[-1, 0, 0, 0]) == 8191 % 251
    grown = pa.total_allocated_bytes() - before
    assert grown < 64 * 1024, f"open_shard + read allocated {grown} bytes"
    # The numpy views point into the memory map, not into a private copy.
    assert not images.flags.owndata


def test_verify_detects_flipped_byte(tmp_path: Path) -> None:
    path, checksum = write(make_table(1000), tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError) as info:
        verify_shard(path, checksum)
    assert str(path) in str(info.value)
    assert checksum in str(info.value)


@pytest.mark.parametrize("keep", [0, 7, 100, 0.5, -1])
def test_open_truncated_shard_raises(tmp_path: Path, keep: float) -> None:
    path, _ = write(make_table(1000), tmp_path)
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    path.write_bytes(data[:cut])
    with pytest.raises(ShardCorruptError) as info:
        open_shard(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value.__cause__, pa.ArrowInvalid)


def test_open_not_arrow_raises(tmp_path: Path) -> None:
    path = tmp_path / "junk.arrow"
    path.write_bytes(b"this is not an arrow file at all" * 10)
    with pytest.raises(ShardCorruptError):
        open_shard(path)


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = shards._write_file

    def write_then_fail(path: Path, table: pa.Table) -> None:
        assert path == tmp_path / "s1.arrow.tmp"  # the write goes to the temp path first
        path.write_bytes(b"ARROW1\x00\x00" + b"\x00" * 4096)  # some bytes reach the temp file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards, "_write_file", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        write(make_table(100), tmp_path)
    assert not (tmp_path / "s1.arrow.tmp").exists()
    assert not (tmp_path / "s1.arrow").exists()
    assert list(tmp_path.iterdir()) == []

    # The same paths work once the fault is gone.
    monkeypatch.setattr(shards, "_write_file", real_write)
    path, checksum = write(make_table(100), tmp_path)
    verify_shard(path, checksum)


def test_failed_write_keeps_existing_final_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old_table = make_table(10)
    path, checksum = write(old_table, tmp_path)

    def fail(path: Path, table: pa.Table) -> None:
        path.write_bytes(b"partial")
        raise OSError("disk gone")

    monkeypatch.setattr(shards, "_write_file", fail)
    with pytest.raises(OSError):
        write(make_table(20), tmp_path)
    verify_shard(path, checksum)
    assert open_shard(path).equals(old_table)
    assert not (tmp_path / "s1.arrow.tmp").exists()


def test_final_path_can_depend_on_the_checksum(tmp_path: Path) -> None:
    checksum = write_shard(make_table(5), tmp_path / "x.arrow.tmp", lambda c: tmp_path / f"x.{c}.arrow")
    assert [p.name for p in tmp_path.iterdir()] == [f"x.{checksum}.arrow"]
    verify_shard(tmp_path / f"x.{checksum}.arrow", checksum)


def test_record_meta_round_trip(tmp_path: Path) -> None:
    meta = ShardMeta(id="abc-1", created=12.5, units=("a.parquet#0", "b.parquet#3"))
    table = with_record_meta(make_table(7), meta)
    path, _ = write(table, tmp_path)
    assert read_record_meta(path) == (meta, 7)
    assert encoded_size(table) == path.stat().st_size  # the metadata is part of the exact size


def test_record_meta_missing_is_corrupt(tmp_path: Path) -> None:
    path, _ = write(make_table(3), tmp_path)
    with pytest.raises(ShardCorruptError, match="no valid epochcache record metadata"):
        read_record_meta(path)


@pytest.mark.parametrize("most", [40_000, None], ids=["short-writes", "whole-writes"])
def test_chunked_writes_hand_over_every_byte_in_order_in_bounded_pieces(most: int | None) -> None:
    offered: list[int] = []
    written: list[bytes] = []

    def write(piece: memoryview) -> int:  # takes at most ``most`` bytes a call, as write(2) may
        offered.append(len(piece))
        written.append(bytes(piece[:most]))
        return len(written[-1])

    data = bytes(range(256)) * 1000  # 256,000 bytes: 3 full chunks and a part
    sink = shards.ChunkedWrites(write)
    assert sink.write(pa.py_buffer(data)) == len(data)
    assert sink.write(b"tail") == 4
    assert b"".join(written) == data + b"tail"
    assert max(offered) == shards.WRITE_CHUNK


def _resident_kib(path: Path) -> int:
    """This process's resident KiB in mappings of ``path`` (Linux /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = line.rstrip().endswith(str(path))
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def _filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (Linux /proc/self/mounts: the longest mount point above it)."""
    with open("/proc/self/mounts") as mounts:
        # (the kernel writes a space in a mount point as \040, a tab as \011 and so on)
        points = [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]), fields[2])
                  for fields in map(str.split, mounts)]
    return max((p for p in points if path.is_relative_to(p[0])), key=lambda p: len(p[0]))[1]


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="measures mappings through Linux's /proc")
def test_reading_one_row_of_a_fresh_shard_maps_little_of_it(tmp_path: Path) -> None:
    if _filesystem(tmp_path) == "tmpfs":
        pytest.skip("tmpfs sizes its pages by its huge-page policy, not by the writes")
    # The page cache keeps a freshly written file in folios as large as its writes allowed (up to
    # 2 MiB on Linux 6.x), and a reader's first touch maps a whole folio: one 12 KB row read, 2 MiB
    # counted in the trainer's RSS. Shards are written in pieces, so a touch maps ~64 KiB.
    rows = 2048
    table = pa.table({"x": pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(12288), rows, [None, pa.py_buffer(bytes(range(256)) * (48 * rows))])})
    path, _ = write(table, tmp_path)
    column = open_shard(path).column("x").chunk(0)
    touched = range(100, rows, 256)
    assert [column[i].as_py()[:2] for i in touched] == [bytes([0, 1])] * len(touched)
    assert 0 < _resident_kib(path) <= 256 * len(touched)
