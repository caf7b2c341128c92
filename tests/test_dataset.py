"""ShardSetDataset: batched gathers over memory-mapped shards, values and shapes exact."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from conftest import ITEM_SHAPE, make_table
from torch.utils.data import DataLoader

from epochcache.dataset import OpenShards, ShardSetDataset
from epochcache.errors import LoaderError
from epochcache.shards import write_shard
from epochcache.sources.base import KEY_COLUMN


def _shards(tmp_path: Path, sizes: list[int]) -> tuple[list[Path], list[int]]:
    paths, start = [], 0
    for number, rows in enumerate(sizes):
        table = make_table(rows, start)
        table = table.append_column(KEY_COLUMN, pc.cast(table["id"], pa.string()))
        path = tmp_path / f"s{number}.arrow"
        write_shard(table.combine_chunks(), tmp_path / f"s{number}.arrow.tmp", path)
        paths.append(path)
        start += rows
    return paths, sizes


def _check_rows(batch: dict, expected_ids: np.ndarray) -> None:
    ids = batch["id"].numpy()
    assert sorted(ids.tolist()) == sorted(expected_ids.tolist())
    assert batch["image"].shape == (len(expected_ids), *ITEM_SHAPE)
    assert batch["image"].dtype == torch.uint8
    expected_pixels = torch.from_numpy((ids % 251).astype(np.uint8))[:, None, None, None].expand(-1, *ITEM_SHAPE)
    assert torch.equal(batch["image"], expected_pixels)


def test_getitems_gathers_across_shards(tmp_path: Path) -> None:
    ds = ShardSetDataset(*_shards(tmp_path, [10, 7, 13]))
    assert len(ds) == 30
    wanted = np.array([29, 0, 12, 9, 10, 16, 17, 3])
    batch = ds.__getitems__(wanted)
    assert set(batch) == {"image", "id"}, "the key column is left out by default"
    _check_rows(batch, wanted)


def test_getitem_returns_one_sample(tmp_path: Path) -> None:
    ds = ShardSetDataset(*_shards(tmp_path, [5, 5]))
    sample = ds[7]
    assert int(sample["id"]) == 7
    assert sample["image"].shape == ITEM_SHAPE


def test_out_of_range_index_raises(tmp_path: Path) -> None:
    ds = ShardSetDataset(*_shards(tmp_path, [5]))
    with pytest.raises(IndexError):
        ds.__getitems__([5])
    with pytest.raises(IndexError):
        ds.__getitems__([-1])


def test_string_column_comes_as_zero_copy_buffers(tmp_path: Path) -> None:
    paths, rows = _shards(tmp_path, [4, 4])
    ds = ShardSetDataset(paths, rows, columns=["id", KEY_COLUMN])
    batch = ds.__getitems__([6, 1])
    keys = batch[KEY_COLUMN]
    assert isinstance(keys, list) and all(isinstance(b, pa.Buffer) for b in keys)
    assert [bytes(b).decode() for b in keys] == [str(int(i)) for i in batch["id"]]
    mapped = ds._open()[0][KEY_COLUMN]._data  # shard 0's one mapped data buffer (batch grouped by shard)
    assert mapped.address <= keys[0].address < mapped.address + mapped.size, "a slice of the mapping, not a copy"


def test_binary_nulls_nested_lists_and_fixed_shapes(tmp_path: Path) -> None:
    grid = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
    nested = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(pa.array(grid.ravel()), 3), 2)
    table = pa.table({
        "blob": pa.array([b"ab", None, b"", b"xyz"], pa.large_binary()),
        "grid": nested,
        "tensor": pa.FixedShapeTensorArray.from_numpy_ndarray(grid.astype(np.int16)),
        "ragged": pa.array([[1], [], [2, 3], [4]]),
    })
    write_shard(table, tmp_path / "t.tmp", tmp_path / "t.arrow")
    batch = ShardSetDataset([tmp_path / "t.arrow"], [4]).__getitems__([3, 1, 2])
    assert [None if b is None else bytes(b) for b in batch["blob"]] == [b"xyz", None, b""]
    assert batch["grid"].shape == (3, 2, 3) and torch.equal(batch["grid"], torch.from_numpy(grid[[3, 1, 2]]))
    assert batch["tensor"].dtype == torch.int16 and torch.equal(batch["tensor"], torch.from_numpy(grid[[3, 1, 2]]).short())
    assert isinstance(batch["ragged"], pa.Array) and batch["ragged"].to_pylist() == [[4], [], [2, 3]]


def test_pickle_carries_paths_not_data(tmp_path: Path) -> None:
    ds = ShardSetDataset(*_shards(tmp_path, [2000, 2000]))
    ds.__getitems__([0, 3999])  # opens (maps) the shards in this process
    data = pickle.dumps(ds)
    assert len(data) < 4096, "pickling must not copy shard contents to DataLoader workers"
    clone = pickle.loads(data)
    _check_rows(clone.__getitems__([3999, 1]), np.array([3999, 1]))


def test_workers_yield_the_same_samples(tmp_path: Path) -> None:
    ds = ShardSetDataset(*_shards(tmp_path, [50, 30, 20]))
    batches = [np.arange(i, min(i + 16, 100)) for i in range(0, 100, 16)]

    def ids(workers: int) -> list[int]:
        loader = DataLoader(ds, batch_sampler=batches, num_workers=workers, collate_fn=lambda b: b)
        return sorted(int(i) for batch in loader for i in batch["id"])

    assert ids(0) == list(range(100))
    assert ids(2) == list(range(100))


def test_column_kind_follows_the_type_and_nulls_are_refused(tmp_path: Path) -> None:
    clean = pa.table({"x": pa.array([1.0, 2.0], pa.float64()), "tag": pa.array(["a", "b"])})
    holey = pa.table({"x": pa.array([3.0, None], pa.float64()), "tag": pa.array(["c", None])})
    paths = []
    for name, table in (("clean", clean), ("holey", holey)):
        write_shard(table, tmp_path / f"{name}.tmp", tmp_path / f"{name}.arrow")
        paths.append(tmp_path / f"{name}.arrow")
    ds = ShardSetDataset(paths[:1], [2])
    batch = ds.__getitems__([1, 0])
    assert isinstance(batch["x"], torch.Tensor) and [bytes(b) for b in batch["tag"]] == [b"b", b"a"]
    with pytest.raises(LoaderError, match="'x'.*1 nulls"):
        ShardSetDataset(paths, [2, 2]).__getitems__([0, 3])
    only_tags = ShardSetDataset(paths, [2, 2], columns=["tag"]).__getitems__([0, 3])
    assert [None if b is None else bytes(b) for b in only_tags["tag"]] == [b"a", None]


def test_unknown_column_is_a_loader_error(tmp_path: Path) -> None:
    ds = ShardSetDataset(*_shards(tmp_path, [3]), columns=["id", "nope"])
    with pytest.raises(LoaderError, match="nope"):
        ds.__getitems__([0])


def test_consecutive_datasets_reuse_the_shards_both_read(tmp_path: Path) -> None:
    paths, rows = _shards(tmp_path, [5, 6, 7])
    opened = OpenShards()
    first = ShardSetDataset(paths[:2], rows[:2], opened=opened)
    second = ShardSetDataset(paths[1:], rows[1:], opened=opened)
    _check_rows(first.__getitems__(np.arange(11)), np.arange(11))
    _check_rows(second.__getitems__(np.arange(13)), np.arange(5, 18))
    assert second._open()[0] is first._open()[1], "the shard both read is mapped once"
    third = ShardSetDataset(paths[:1], rows[:1], opened=opened)
    third.__getitems__([0])
    assert third._open()[0] is not first._open()[0], "a shard the latest dataset did not read is not kept"
    assert pickle.loads(pickle.dumps(second))._opened is None, "workers map their own"
