"""ShardSetDataset: batched gathers over memory-mapped shards, values and shapes exact."""

from __future__ import annotations

import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.feather
import pytest
import torch
from conftest import ITEM_SHAPE, make_table
from torch.utils.data import DataLoader

from epochcache.cache.shards import write_shard
from epochcache.errors import LoaderError, ShardCorruptError
from epochcache.sources.base import KEY_COLUMN
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.held import distinct
from epochcache.train.jobs import FENCE
from epochcache.train.mappings import ShardMaps
from epochcache.train.order import EpochBatches, batch_count, epoch_order
from epochcache.train.prefetch import BatchThread


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


def test_a_batch_comes_in_the_order_asked_whatever_the_shards_and_open_maps(tmp_path: Path) -> None:
    paths, rows = _shards(tmp_path, [3, 1, 5, 2, 4])
    wanted = np.random.default_rng(0).permutation(15)
    for max_open in (1, 2, 5):  # fewer open maps than shards touched: gathered in parts of max_open shards
        ds = ShardSetDataset(paths, rows, columns=["id", "image", KEY_COLUMN], max_open_shards=max_open)
        batch = ds.__getitems__(wanted)
        if max_open == 5:
            assert batch["id"].tolist() == wanted.tolist(), "one part: exactly the order asked"
        assert sorted(batch["id"].tolist()) == list(range(15))
        assert batch[KEY_COLUMN] == [str(i) for i in batch["id"].tolist()], "string column in the same row order"
        _check_rows(batch, wanted)


@pytest.mark.slow  # (a fresh process: 4 s)
def test_a_first_batch_in_a_fresh_process_imports_no_numpy_ma(tmp_path: Path) -> None:
    # numpy 2.x's np.unique imports numpy.ma on its first call: 20 ms measured, in each worker and on
    # the way to an epoch's first batch (the shard numbers are deduplicated by held.distinct instead)
    paths, rows = _shards(tmp_path, [3, 1, 5, 2, 4])
    script = (
        "import sys, numpy as np\n"
        "from epochcache.train.dataset import ShardSetDataset\n"
        "print('numpy.ma' in sys.modules)\n"
        f"ds = ShardSetDataset({[str(p) for p in paths]!r}, {rows!r}, max_open_shards=2)\n"
        "ds.open()\n"
        "batch = ds.__getitems__(np.random.default_rng(0).permutation(15))\n"
        "print(sorted(batch['id'].tolist()) == list(range(15)), 'numpy.ma' in sys.modules)\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    imported, *after = ran.stdout.split()
    if imported == "True":  # (seen on a GPU image: numpy 2.5, pyarrow 25, torch 2.11; nothing of ours to measure)
        pytest.skip("the libraries' own imports load numpy.ma before the dataset runs")
    assert after == ["True", "False"], ran.stdout + ran.stderr


@pytest.mark.parametrize("numbers", [[], [4], [5, 1, 5, 2, 1, 9], list(np.random.default_rng(1).integers(0, 40, 500))])
def test_distinct_is_np_unique(numbers: list[int]) -> None:
    values = np.asarray(numbers, dtype=np.int64)
    assert np.array_equal(distinct(values), np.unique(values))


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


def test_string_columns_and_the_key_come_as_str(tmp_path: Path) -> None:
    paths, rows = _shards(tmp_path, [4, 4])
    ds = ShardSetDataset(paths, rows, columns=["id", KEY_COLUMN])
    batch = ds.__getitems__([6, 1])
    assert batch[KEY_COLUMN] == [str(int(i)) for i in batch["id"]] and batch[KEY_COLUMN] == ["6", "1"]
    table = pa.table({"text": pa.array(["é", None, "xyz"], pa.large_string())})
    write_shard(table, tmp_path / "t.tmp", tmp_path / "t.arrow")
    assert ShardSetDataset([tmp_path / "t.arrow"], [3]).__getitems__([2, 1, 0])["text"] == ["xyz", None, "é"]


def test_binary_column_comes_as_zero_copy_buffers(tmp_path: Path) -> None:
    table = pa.table({"blob": pa.array([b"ab", b"cde", b"f"], pa.binary())})
    write_shard(table, tmp_path / "t.tmp", tmp_path / "t.arrow")
    ds = ShardSetDataset([tmp_path / "t.arrow"], [3])
    blobs = ds.__getitems__([1, 2])["blob"]
    assert all(isinstance(b, pa.Buffer) for b in blobs) and [bytes(b) for b in blobs] == [b"cde", b"f"]
    views = ds._shards.views(0)
    assert views is not None
    mapped = views["blob"]._data  # type: ignore[union-attr]  # the shard's one mapped data buffer
    assert mapped.address <= blobs[0].address < mapped.address + mapped.size, "a slice of the mapping, not a copy"


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
    assert batch["tensor"].dtype == torch.int16
    assert torch.equal(batch["tensor"], torch.from_numpy(grid[[3, 1, 2]]).short())
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
    assert isinstance(batch["x"], torch.Tensor) and batch["tag"] == ["b", "a"]
    with pytest.raises(LoaderError, match="'x'.*1 nulls"):
        ShardSetDataset(paths, [2, 2]).__getitems__([0, 3])
    only_tags = ShardSetDataset(paths, [2, 2], columns=["tag"]).__getitems__([0, 3])
    assert only_tags["tag"] == ["a", None]


def test_unknown_column_is_a_loader_error(tmp_path: Path) -> None:
    ds = ShardSetDataset(*_shards(tmp_path, [3]), columns=["id", "nope"])
    with pytest.raises(LoaderError, match="nope"):
        ds.__getitems__([0])


def test_consecutive_datasets_reuse_the_shards_both_read(tmp_path: Path) -> None:
    paths, rows = _shards(tmp_path, [5, 6, 7])
    maps: ShardMaps = ShardMaps(2)
    first = ShardSetDataset(paths[:2], rows[:2], maps=maps)
    second = ShardSetDataset(paths[1:], rows[1:], maps=maps)
    _check_rows(first.__getitems__(np.arange(11)), np.arange(11))
    shared = first._shards.views(1)
    _check_rows(second.__getitems__(np.arange(6)), np.arange(5, 11))
    assert second._shards.views(0) is shared, "the shard both read is mapped once"
    _check_rows(second.__getitems__(np.arange(13)), np.arange(5, 18))
    assert len(maps) == 2, "at most max_open_shards mappings are kept"
    assert first._shards.views(0) is not None and len(maps) == 2
    assert pickle.loads(pickle.dumps(second))._shards._maps is None, "workers map their own"


@pytest.mark.parametrize("kept", [100, 0], ids=["truncated", "emptied"])
def test_unreadable_shard_rows_are_left_out_and_reported(tmp_path: Path, kept: int) -> None:
    paths, rows = _shards(tmp_path, [5, 6, 7])
    paths[1].write_bytes(paths[1].read_bytes()[:kept])  # cut after it was listed (an empty file cannot be mapped)
    told: list[tuple[str, type]] = []
    ds = ShardSetDataset(paths, rows, on_unreadable=lambda path, exc: told.append((path, type(exc))))
    batch = ds.__getitems__(np.arange(18))
    _check_rows(batch, np.r_[0:5, 11:18])
    assert told == [(str(paths[1]), ShardCorruptError)]
    ds.__getitems__([6])
    assert told == [(str(paths[1]), ShardCorruptError)], "reported once"


@pytest.mark.parametrize(("shards", "max_open"), [(1_000, 32), pytest.param(100_000, 1024, marks=pytest.mark.soak)])
def test_an_epoch_over_many_tiny_shards_keeps_few_maps_open(tmp_path: Path, shards: int, max_open: int) -> None:
    # issue 10: one map per shard failed at 70,000 shards (vm.max_map_count is 65,530 by default)
    table = pa.table({"x": pa.array([0], pa.int64())})
    paths = []
    for number in range(shards):
        path = tmp_path / f"s{number}.arrow"
        pa.feather.write_feather(table.set_column(0, "x", pa.array([number], pa.int64())), path,
                                 compression="uncompressed")
        paths.append(path)
    maps: ShardMaps = ShardMaps(max_open)
    ds = ShardSetDataset(paths, [1] * shards, maps=maps)
    total = 0
    for start in range(0, shards, 1000):
        batch = ds.__getitems__(np.arange(start, min(start + 1000, shards)))
        total += int(batch["x"].sum())
        assert len(maps) <= max_open
    assert total == shards * (shards - 1) // 2
    assert sum(int(ds.__getitems__(np.arange(shards))["x"].sum()) for _ in range(2)) == shards * (shards - 1)


class _CountingMaps(ShardMaps):
    """ShardMaps that count how often a shard had to be mapped (a miss)."""

    opened = 0

    def get(self, key, open_one):  # type: ignore[no-untyped-def]
        def counted():  # type: ignore[no-untyped-def]
            self.opened += 1
            return open_one()
        return super().get(key, counted)


def test_an_epoch_over_more_shards_than_open_maps_maps_each_about_once_in_windowed_order(tmp_path: Path) -> None:
    paths, rows = _shards(tmp_path, [4] * 200)
    opened = {}
    for name, order in (("plain", epoch_order(800, 0, 0, True)),
                        ("windowed", epoch_order(800, 0, 0, True, shard_rows=rows, window=10))):
        maps = _CountingMaps(20)
        ds = ShardSetDataset(paths, rows, maps=maps)
        seen = np.concatenate([ds.__getitems__(order[i : i + 16])["id"].numpy() for i in range(0, 800, 16)])
        assert sorted(seen.tolist()) == list(range(800))
        opened[name] = maps.opened
    # Each shard once (a window of 10 fits in 20 open maps), and shard 0 for the batch template first.
    assert opened["windowed"] <= 201, opened
    assert opened["plain"] > 3 * 200, opened  # a shuffle over all 200 maps most shards at every touch


def _same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert list(a) == list(b), "the columns, in the schema's order"
        for name in b:
            assert torch.equal(a[name], b[name]) if isinstance(b[name], torch.Tensor) else a[name] == b[name]


@pytest.mark.parametrize("max_open", [64, 3, 1])
def test_planned_batches_are_the_batches_getitems_gives(tmp_path: Path, max_open: int) -> None:
    # max_open 3: runs of up to 3 shards are planned (held together, the shards of earlier runs
    # dropped), longer ones gathered batch by batch; 1: every batch touching 2 shards goes in parts
    paths, rows = _shards(tmp_path, [4, 4, 4, 4, 4, 4, 9])
    for order in (np.arange(33), epoch_order(33, 0, 0, True)):
        sampler = EpochBatches(order, 4, batch_count(33, 4, drop_last=False), start=1)
        planned = list(ShardSetDataset(paths, rows, max_open_shards=max_open).batches(sampler))
        reference = ShardSetDataset(paths, rows, max_open_shards=max_open)
        _same_batches(planned, [reference.__getitems__(indices) for indices in sampler])
        assert sorted(torch.cat([b["id"] for b in planned]).tolist()) == sorted(order[4:].tolist())
        for batch, indices in zip(planned, sampler):
            _check_rows(batch, indices)


def test_planned_batches_leave_out_an_unreadable_shard_and_keep_other_columns(tmp_path: Path) -> None:
    paths, rows = _shards(tmp_path, [5, 6, 7])
    paths[1].write_bytes(paths[1].read_bytes()[:100])
    sampler = EpochBatches(np.arange(18), 4, batch_count(18, 4, drop_last=False))
    columns = ["id", KEY_COLUMN, "image"]  # a string column beside the tensors
    planned = list(ShardSetDataset(paths, rows, columns=columns).batches(sampler))
    _same_batches(planned, [ShardSetDataset(paths, rows, columns=columns).__getitems__(i) for i in sampler])
    assert torch.cat([b["id"] for b in planned]).tolist() == [*range(5), *range(11, 18)]
    assert [k for b in planned for k in b[KEY_COLUMN]] == [str(i) for i in [*range(5), *range(11, 18)]]


@pytest.mark.parametrize("max_open", [64, 1])
def test_gather_into_writes_the_rows_getitems_gives(tmp_path: Path, max_open: int) -> None:
    # max_open 1: a batch over 4 shards is gathered in 4 parts, one after the other (one of them all
    # unreadable rows, which failed in the string column's gather before)
    paths, rows = _shards(tmp_path, [5, 6, 7, 4])
    paths[1].write_bytes(paths[1].read_bytes()[:100])  # unreadable: its rows are left out
    wanted = np.array([17, 2, 8, 11, 0, 20, 13])
    columns = [KEY_COLUMN, "image", "id"]
    want = ShardSetDataset(paths, rows, columns=columns, max_open_shards=max_open).__getitems__(wanted)
    into = {"image": np.full((8, *ITEM_SHAPE), 7, np.uint8), "id": np.full(8, -1, np.int64)}
    written, others = ShardSetDataset(paths, rows, columns=columns, max_open_shards=max_open).gather_into(wanted, into)
    assert written == 6 and others == {KEY_COLUMN: want[KEY_COLUMN]}
    assert into["id"].tolist() == [*want["id"].tolist(), -1, -1]  # (in parts, rows come part by part)
    assert sorted(want["id"].tolist()) == [0, 2, 11, 13, 17, 20]
    assert np.array_equal(into["image"][:6], want["image"].numpy()) and (into["image"][6:] == 7).all()


@pytest.mark.parametrize("max_open", [64, 3])
def test_jobs_built_on_two_threads_are_the_batches_getitems_gives(tmp_path: Path, max_open: int) -> None:
    # max_open 3 over 13 shards: planning a run drops the shards of earlier runs (a FENCE before it), while
    # the batch thread and the consumer build batches of the run before; the data must stay exact
    paths, rows = _shards(tmp_path, [4] * 12 + [9])
    n = sum(rows)
    for epoch in range(3):
        sampler = EpochBatches(epoch_order(n, 0, epoch, True), 4, batch_count(n, 4, drop_last=False))
        fences = sum(job is FENCE for job in ShardSetDataset(paths, rows, max_open_shards=max_open).jobs(sampler))
        assert (fences > 0) == (max_open < len(paths))
        with ThreadPoolExecutor(1) as pool:
            thread = BatchThread(ShardSetDataset(paths, rows, max_open_shards=max_open).jobs(sampler), 1, pool)
            built = list(thread)
            thread.close()
        reference = ShardSetDataset(paths, rows, max_open_shards=max_open)
        _same_batches(built, [reference.__getitems__(indices) for indices in sampler])
        for batch, indices in zip(built, sampler):
            _check_rows(batch, indices)


def test_rows_over_64_kb_are_gathered(tmp_path: Path) -> None:
    # a view of the whole address range in rows of 150 KB would be over 2**63 bytes: numpy refused it
    images = np.random.default_rng(0).integers(0, 256, (6, 3, 224, 224), dtype=np.uint8)
    table = pa.table({"image": pa.FixedShapeTensorArray.from_numpy_ndarray(images)})
    write_shard(table, tmp_path / "big.arrow.tmp", tmp_path / "big.arrow")
    dataset = ShardSetDataset([tmp_path / "big.arrow"], [6])
    assert np.array_equal(dataset.__getitems__([4, 1])["image"].numpy(), images[[4, 1]])
    into = {"image": np.zeros((2, 3, 224, 224), np.uint8)}
    assert dataset.gather_into([5, 0], into)[0] == 2 and np.array_equal(into["image"], images[[5, 0]])
