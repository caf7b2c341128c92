"""loader.max_mapped_bytes: each reading process lets its mapped shard pages go past the bound, and
the data read after that is the same."""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from epochcache import EpochCachedLoader
from epochcache.config import Config
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.mappings import STATM, ShardMaps
from epochcache.train.shardplan import map_file

pytestmark = pytest.mark.skipif(not os.path.exists(STATM), reason="needs Linux's /proc/self/statm")


def _resident(path: Path) -> int:
    """Bytes of the mappings of ``path`` (a file, or every file in a folder) resident in this process
    (their ``Rss`` lines in one read of its smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = fields[-1] == str(path) or Path(fields[-1]).parent == path
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def _rows(path: Path) -> int:
    return pa.ipc.open_file(str(path)).read_all().num_rows


class _Measure:
    """A scripted ``measure`` for ShardMaps: the process's mapped bytes as the test sets them."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def _file(tmp_path: Path, name: str) -> tuple[Path, np.ndarray]:
    path = tmp_path / name
    data = np.random.default_rng(0).integers(0, 256, 2**20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data


def _opener(path: Path) -> Callable[[], tuple[np.ndarray, mmap.mmap]]:
    def open_one() -> tuple[np.ndarray, mmap.mmap]:
        mapped, whole = map_file(str(path))
        return np.frombuffer(whole, np.uint8), mapped
    return open_one


def test_trim_lets_the_pages_go_only_past_the_bound_and_the_bytes_stay(tmp_path: Path) -> None:
    path, data = _file(tmp_path, "shard.bin")
    measure = _Measure()
    maps: ShardMaps[np.ndarray] = ShardMaps(4, max_mapped_bytes=1000, measure=measure)
    view = maps.get("shard", _opener(path))
    assert int(view.sum()) == int(data.sum())  # every page touched
    assert _resident(path) == 2**20
    measure.value = 1000  # grown by the bound, not past it
    assert not maps.trim() and _resident(path) == 2**20
    measure.value = 1001
    assert maps.trim()
    assert _resident(path) == 0, "the mapping's pages were let go"
    assert np.array_equal(view, data), "and read again as they were"
    assert not maps.trim(), "the bound counts from the release"


def test_a_mapping_dropped_from_the_set_but_still_read_is_let_go_too(tmp_path: Path) -> None:
    path, data = _file(tmp_path, "old.bin")
    measure = _Measure()
    maps: ShardMaps[np.ndarray] = ShardMaps(4, max_mapped_bytes=1000, measure=measure)
    view = maps.get("old", _opener(path))
    maps.retain(set())  # the next epoch reads other shards; this one's epoch still holds the view
    assert len(maps) == 0 and int(view.sum()) == int(data.sum())
    measure.value = 5000
    assert maps.trim() and _resident(path) == 0
    del view  # unmapped now: the set holds it weakly, so a later release never touches it
    gc.collect()
    measure.value = 10000
    assert maps.trim()


def test_unbounded_maps_never_measure() -> None:
    def fails() -> int:
        raise AssertionError("measured without a bound")

    assert not ShardMaps(4, measure=fails).trim()


def test_a_dataset_sent_to_a_worker_keeps_the_bound(tmp_path: Path, synced_cache: Callable[..., Config]) -> None:
    config = synced_cache(files=2, rows_per_file=64, rows_per_group=32, shard_bytes="64KiB")
    shards = sorted((Path(config.cache.dir) / "shards").glob("*.arrow"))
    dataset = ShardSetDataset(shards, [_rows(p) for p in shards], max_mapped_bytes=12345)
    received = pickle.loads(pickle.dumps(dataset))
    assert received.max_mapped_bytes == 12345
    received.__getitems__([0, 1])
    assert received._shards._maps is not None and received._shards._maps.max_mapped_bytes == 12345


class _ShardResidence:
    """A batch transform that adds, on every 16th batch it builds, the bytes of the cache's shard files
    resident in the process building it (``resident``; -1 on the others: smaps costs ~6 ms a read)."""

    def __init__(self, shards: Path) -> None:
        self.shards, self.built = shards, 0

    def __call__(self, batch: dict) -> dict:
        self.built += 1
        resident = -1
        if self.built % 16 == 1:
            resident = _resident(self.shards)
        return {**batch, "resident": torch.tensor(resident)}


@pytest.mark.slow  # (5-7 s each, and forked workers)
@pytest.mark.parametrize("workers", [0, 2])
def test_bounded_mapped_pages_stay_near_the_bound_and_give_the_same_batches(
    synced_cache: Callable[..., Config], workers: int
) -> None:
    config = synced_cache(files=6, rows_per_file=128, rows_per_group=32, shard_bytes="64KiB")
    shards = Path(config.cache.dir) / "shards"
    total = sum(p.stat().st_size for p in shards.glob("*.arrow"))
    assert len(list(shards.glob("*.arrow"))) >= 12
    seen: dict[str | None, list[dict[str, torch.Tensor]]] = {}
    for bound in (None, "4KB"):
        with EpochCachedLoader(config.cache.dir, batch_size=1, num_workers=workers, transform=_ShardResidence(shards),
                               progress=False, max_mapped_bytes=bound, seed=3) as loader:
            seen[bound] = [{k: v.clone() for k, v in b.items()} for b in loader]
    unbounded = max(int(b["resident"]) for b in seen[None])
    bounded = max(int(b["resident"]) for b in seen["4KB"])
    assert unbounded >= 0.9 * total, "without a bound, every shard read stays mapped"
    # A bound below one row: the pages go before every batch is built, so what stays mapped is the
    # batch's own shard and those of batches built beside it (the batch thread's, the consumer
    # helping it, the next epoch's opening): a few of the 12 or more (here: 1-3 on the thread, 1 in
    # a worker, measured), never most of them.
    assert bounded <= total / 2, (bounded, total)
    assert len(seen[None]) == len(seen["4KB"]) == 6 * 128
    for a, b in zip(seen[None], seen["4KB"]):
        assert all(torch.equal(a[k], b[k]) for k in a if k != "resident"), "the same rows, byte for byte"


@pytest.mark.slow  # (3-4 s)
def test_the_batch_thread_lets_a_batchs_pages_go_once_it_is_built(synced_cache: Callable[..., Config]) -> None:
    config = synced_cache(files=4, rows_per_file=64, rows_per_group=32, shard_bytes="64KiB")
    shards = Path(config.cache.dir) / "shards"
    with EpochCachedLoader(config.cache.dir, batch_size=1, progress=False, max_mapped_bytes="4KB") as loader:
        resident = [_resident(shards) for number, _ in enumerate(loader) if number % 4 == 0]
    # Seen by the trainer between batches: the batches built ahead were trimmed as their last step,
    # so mostly no shard page is mapped; without that step, each leaves its row's pages until the next.
    assert statistics.median(resident) == 0, sorted(resident)[len(resident) // 2 :][:20]
