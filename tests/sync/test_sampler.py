"""Tests for epochcache.sync.sampler and epochcache.seeding over a real local Parquet folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from conftest import write_parquet_dataset
from pydantic import ValidationError

from epochcache.errors import ConfigError
from epochcache.seeding import permutation
from epochcache.sources.base import RemoteObject, Unit
from epochcache.sources.parquet import ParquetSource
from epochcache.sync.sampler import Cursor, Sampler, UnitsOf

FILES = 4
ROWS_PER_FILE = 50
ROWS_PER_GROUP = 12  # 5 groups per file: 12, 12, 12, 12, 2


@pytest.fixture
def source(tmp_path: Path) -> ParquetSource:
    root = str(tmp_path / "remote")
    fs = fsspec.filesystem("file")
    fs.makedirs(root, exist_ok=True)
    write_parquet_dataset(fs, root, files=FILES, rows_per_file=ROWS_PER_FILE, rows_per_group=ROWS_PER_GROUP)
    return ParquetSource(root)


@pytest.fixture
def objects(source: ParquetSource) -> list[RemoteObject]:
    return source.list_objects()


def units_of(source: ParquetSource) -> UnitsOf:
    return lambda objects: [source.units(obj) for obj in objects]


def walk_keys(sampler: Sampler, cursor: Cursor) -> list[str]:
    return [unit.key for unit, _ in sampler.walk(cursor)]


def all_keys(source: ParquetSource, objects: list[RemoteObject]) -> set[str]:
    return {unit.key for obj in objects for unit in source.units(obj)}


def test_one_pass_yields_every_unit_once(source: ParquetSource, objects: list[RemoteObject]) -> None:
    keys = walk_keys(Sampler(units_of(source), objects, seed=1), Cursor())
    assert len(keys) == FILES * 5
    assert len(set(keys)) == len(keys)
    assert set(keys) == all_keys(source, objects)


def test_one_pass_covers_every_row_once(source: ParquetSource, objects: list[RemoteObject]) -> None:
    ids: list[int] = []
    for unit, _ in Sampler(units_of(source), objects, seed=3).walk(Cursor()):
        ids.extend(source.read(unit).column("id").to_pylist())
    assert sorted(ids) == list(range(FILES * ROWS_PER_FILE))


def test_walk_yields_units(source: ParquetSource, objects: list[RemoteObject]) -> None:
    unit, after = next(iter(Sampler(units_of(source), objects, seed=0).walk(Cursor())))
    assert isinstance(unit, Unit)
    assert isinstance(after, Cursor)
    assert after.pass_ == 0


def test_same_seed_same_order(source: ParquetSource, objects: list[RemoteObject]) -> None:
    first = walk_keys(Sampler(units_of(source), objects, seed=5), Cursor())
    second = walk_keys(Sampler(units_of(source), objects, seed=5), Cursor())
    assert first == second


def test_order_is_shuffled(source: ParquetSource, objects: list[RemoteObject]) -> None:
    storage_order = [unit.key for obj in objects for unit in source.units(obj)]
    assert walk_keys(Sampler(units_of(source), objects, seed=5), Cursor()) != storage_order


def test_different_seed_different_order(source: ParquetSource, objects: list[RemoteObject]) -> None:
    a = walk_keys(Sampler(units_of(source), objects, seed=5), Cursor())
    b = walk_keys(Sampler(units_of(source), objects, seed=6), Cursor())
    assert a != b
    assert sorted(a) == sorted(b)


def test_different_pass_different_order(source: ParquetSource, objects: list[RemoteObject]) -> None:
    sampler = Sampler(units_of(source), objects, seed=5)
    pass0 = walk_keys(sampler, Cursor())
    pass1 = walk_keys(sampler, Cursor().next_pass())
    pass2 = walk_keys(sampler, Cursor(pass_=2))
    assert pass0 != pass1 != pass2
    assert sorted(pass0) == sorted(pass1) == sorted(pass2)
    assert all(c.pass_ == 1 for _, c in sampler.walk(Cursor(pass_=1)))


def test_resume_from_every_cursor_yields_exact_suffix(
    source: ParquetSource, objects: list[RemoteObject]
) -> None:
    sampler = Sampler(units_of(source), objects, seed=11)
    full = list(sampler.walk(Cursor()))
    keys = [unit.key for unit, _ in full]
    for i, (_, after) in enumerate(full):
        # A restarted daemon rebuilds everything from the stored cursor dict.
        restored = Cursor.from_dict(after.to_dict())
        resumed = walk_keys(Sampler(units_of(source), source.list_objects(), seed=11), restored)
        assert resumed == keys[i + 1 :], f"resume after unit {i} from {after}"


def test_last_cursor_is_end_of_pass(source: ParquetSource, objects: list[RemoteObject]) -> None:
    sampler = Sampler(units_of(source), objects, seed=2)
    *_, (_, last) = sampler.walk(Cursor())
    assert last == Cursor(pass_=0, group=1, step=0)  # 4 objects fit one group of the default 8
    assert walk_keys(sampler, last) == []
    assert last.next_pass() == Cursor(pass_=1)


def test_cursor_dict_round_trip() -> None:
    cursor = Cursor(pass_=3, group=2, step=9)
    data = cursor.to_dict()
    assert data == {"pass": 3, "group": 2, "step": 9}
    assert Cursor.from_dict({**data, "progress": {"pass": 3}}) == cursor
    assert Cursor.from_dict(None) == Cursor()
    assert Cursor.from_dict({}) == Cursor(0, 0, 0)


def test_permutation_is_deterministic() -> None:
    a = permutation(100, 7, 1)
    b = permutation(100, 7, 1)
    assert a.dtype == np.int64
    assert np.array_equal(a, b)
    assert sorted(a.tolist()) == list(range(100))
    assert not np.array_equal(a, permutation(100, 7, 2))
    assert not np.array_equal(a, permutation(100, 8, 1))
    assert not np.array_equal(permutation(100, 7, 1, 0), permutation(100, 7, 1, 1))
    assert permutation(0, 1).tolist() == []


def test_permutation_known_value() -> None:
    # Pinned so that a change of generator (which would reorder every existing cache) is noticed.
    assert permutation(10, 1, 2).tolist() == [8, 5, 6, 0, 9, 1, 4, 3, 7, 2]


@pytest.mark.parametrize("mix", [1, 2, 3])
def test_groups_interleave_objects_and_resume_exactly(
    source: ParquetSource, objects: list[RemoteObject], mix: int
) -> None:
    sampler = Sampler(units_of(source), objects, seed=4, mix=mix)
    full = list(sampler.walk(Cursor()))
    keys = [unit.key for unit, _ in full]
    assert sorted(keys) == sorted(all_keys(source, objects))
    if mix > 1:  # consecutive units come from different objects while the group has several left
        assert full[0][0].obj != full[1][0].obj
    for i, (_, after) in enumerate(full):
        assert walk_keys(sampler, Cursor.from_dict(after.to_dict())) == keys[i + 1 :]


def test_nodes_split_the_pass_without_overlap(source: ParquetSource, objects: list[RemoteObject]) -> None:
    shares = [walk_keys(Sampler(units_of(source), objects, seed=9, mix=2, node_rank=r, num_nodes=3), Cursor())
              for r in range(3)]
    everything = [key for share in shares for key in share]
    assert len(everything) == len(set(everything)), "no unit is fetched by two nodes"
    assert set(everything) == all_keys(source, objects)
    assert all(shares[1:])  # 4 objects over 3 nodes: every node has work


def test_partition_from_config_or_torchrun_environment() -> None:
    from epochcache.config import SamplerConfig

    assert SamplerConfig().partition(env={}) == (0, 1)
    torchrun = {"GROUP_RANK": "2", "WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"}  # 4 nodes of 8 GPUs
    assert SamplerConfig().partition(env=torchrun) == (2, 4)
    assert SamplerConfig(node_rank=1, num_nodes=3).partition(env=torchrun) == (1, 3)
    with pytest.raises(ConfigError, match="GROUP_RANK"):
        SamplerConfig(num_nodes=2).partition(env=torchrun)
    with pytest.raises(ValidationError, match="node_rank=3 must be below num_nodes=3"):
        SamplerConfig(node_rank=3, num_nodes=3)


def test_a_groups_first_unit_needs_only_its_first_footer(
    source: ParquetSource, objects: list[RemoteObject]
) -> None:
    """Reads start while the group's other footers are still arriving (the first object has a second
    unit, so the first unit is not the group's last); the order and cursors are those of the whole
    group known up front."""
    asked: list[int] = []

    class Arriving(list[list[Unit]]):
        def __getitem__(self, index: Any) -> Any:
            asked.append(index)
            return super().__getitem__(index)

        def __iter__(self) -> Any:
            return (self[i] for i in range(len(self)))

    lazy = Sampler(lambda objs: Arriving(source.units(obj) for obj in objs), objects, seed=7, mix=FILES)
    walk = lazy.walk(Cursor())
    next(walk)
    assert len(source.units(objects[0])) > 1
    assert sorted(set(asked)) == [0], f"the first unit asked for the units of objects {sorted(set(asked))}"
    eager = Sampler(units_of(source), objects, seed=7, mix=FILES)
    assert [(u.key, c) for u, c in lazy.walk(Cursor())] == [(u.key, c) for u, c in eager.walk(Cursor())]
