"""loader.max_mapped_bytes: each reading process lets its mapped shard pages go past the bound, and
the data read after that is the same."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from epochcache import EpochCachedLoader
from epochcache.config import Config
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.mappings import ShardMaps, can_bound_mapped_bytes
from epochcache.train.shardplan import map_file

pytestmark = pytest.mark.skipif(not can_bound_mapped_bytes(), reason="needs Linux's /proc/self/statm")


def _resident(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (its smaps ``Rss`` lines)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = fields[-1] == str(path)
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


def test_trim_lets_the_pages_go_only_past_the_bound_and_the_bytes_stay(tmp_path: Path) -> None:
    path = tmp_path / "shard.bin"
    data = np.random.default_rng(0).integers(0, 256, 2**20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    measure = _Measure()
    maps: ShardMaps[np.ndarray] = ShardMaps(4, max_mapped_bytes=1000, measure=measure)

    def open_one() -> tuple[np.ndarray, object]:
        mapped, whole = map_file(str(path))
        return np.frombuffer(whole, np.uint8), mapped

    view = maps.get("shard", open_one)  # type: ignore[arg-type]
    assert int(view.sum()) == int(data.sum())  # every page touched
    assert _resident(path) == 2**20
    measure.value = 1000  # grown by the bound, not past it
    assert not maps.trim() and _resident(path) == 2**20
    measure.value = 1001
    assert maps.trim() and maps.releases == 1
    assert _resident(path) == 0, "the mapping's pages were let go"
    assert np.array_equal(view, data), "and read again as they were"
    assert not maps.trim(), "the bound counts from the release"


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


@pytest.mark.parametrize("workers", [0, 2])
def test_bounded_mapped_pages_give_the_same_batches(synced_cache: Callable[..., Config], workers: int) -> None:
    config = synced_cache(files=4, rows_per_file=128, rows_per_group=32, shard_bytes="64KiB")
    transform = (lambda batch: batch) if workers else None
    epochs = {}
    for bound in (None, "4KB"):
        with EpochCachedLoader(config.cache.dir, batch_size=16, num_workers=workers, transform=transform,
                               progress=False, max_mapped_bytes=bound) as loader:
            epochs[bound] = [[{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in loader]
                             for _ in range(2)]
            if bound is not None and not workers:
                assert loader._maps.releases > 0, "a bound below one batch lets pages go on every batch"
    for plain, bounded in zip(epochs[None], epochs["4KB"]):
        assert len(plain) == len(bounded) == 4 * 128 // 16
        for a, b in zip(plain, bounded):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
