"""The daemon's start on an empty cache, what a trainer started with it waits for: the walk's first unit
needs the first object's metadata alone (the others' are read together once the second is wanted, in
the same order and with the same cursors as an eager walk), and a run in its own process keeps the heap
it started with away from the cyclic collector for its duration."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pytest
from conftest import DaemonThread, dropped_cycle, wait_for, write_parquet_dataset

import epochcache.sync.daemon as daemon_module
from epochcache import SyncDaemon
from epochcache.config import Config
from epochcache.seeding import permutation
from epochcache.sources.base import RemoteObject, Unit
from epochcache.sync.memory import frozen_objects
from epochcache.sync.sampler import Cursor, Sampler
from epochcache.sync.walk import _Arriving


def objects_with(counts: list[int]) -> tuple[list[RemoteObject], dict[str, list[Unit]]]:
    """Objects holding ``counts[i]`` units each, and each object's units by path."""
    objects = [RemoteObject(f"part-{i:02d}", 100) for i in range(len(counts))]
    units = {obj.path: [Unit(obj, k, 10, None, 10) for k in range(n)] for obj, n in zip(objects, counts)}
    return objects, units


class Asked(Sequence[Sequence[Unit]]):
    """``units`` of ``objects`` handed over when indexed, each index recorded in ``asked``."""

    def __init__(self, objects: Sequence[RemoteObject], units: dict[str, list[Unit]], asked: list[int]):
        self._objects, self._units, self._asked = objects, units, asked

    def __len__(self) -> int:
        return len(self._objects)

    def __getitem__(self, index: int) -> Sequence[Unit]:  # type: ignore[override]
        self._asked.append(index)
        return self._units[self._objects[index].path]


def eager_walk(objects: list[RemoteObject], units: dict[str, list[Unit]], seed: int, mix: int) -> Iterator[
        tuple[Unit, Cursor]]:
    """The walk as it was before the first round became lazy: each group's whole sequence, then its cursors."""
    mine = permutation(len(objects), seed, 0)
    for group in range(-(-len(mine) // mix)):
        members = mine[group * mix : (group + 1) * mix]
        shuffled = [[units[objects[int(i)].path][int(j)]
                     for j in permutation(len(units[objects[int(i)].path]), seed, 0, int(i))] for i in members]
        longest = max((len(u) for u in shuffled), default=0)
        sequence = [u[k] for k in range(longest) for u in shuffled if k < len(u)]
        for step, unit in enumerate(sequence):
            yield unit, Cursor(0, group + 1) if step + 1 == len(sequence) else Cursor(0, group, step + 1)


@pytest.mark.parametrize("counts", [[3, 1, 0, 2, 5, 1], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 1], [1, 0, 0, 0], [2]])
@pytest.mark.parametrize("mix", [1, 2, 4])
def test_the_lazy_walk_yields_the_units_and_cursors_of_the_eager_one(counts: list[int], mix: int) -> None:
    objects, units = objects_with(counts)
    sampler = Sampler(lambda objs: Asked(objs, units, []), objects, seed=7, mix=mix)
    assert list(sampler.walk(Cursor())) == list(eager_walk(objects, units, seed=7, mix=mix))


@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_a_resumed_group_skips_exactly_its_units_before_the_cursor(step: int) -> None:
    objects, units = objects_with([3, 1, 0, 2])
    sampler = Sampler(lambda objs: Asked(objs, units, []), objects, seed=3, mix=4)
    whole = list(sampler.walk(Cursor()))
    assert list(sampler.walk(Cursor(0, 0, step))) == whole[step:]


def test_a_groups_first_unit_asks_for_the_first_objects_units_alone() -> None:
    objects, units = objects_with([3, 2, 2, 2])
    asked: list[int] = []
    walk = Sampler(lambda objs: Asked(objs, units, asked), objects, seed=1, mix=4).walk(Cursor())
    first, _ = next(walk)
    mine = permutation(len(objects), 1, 0)
    assert first.obj == objects[int(mine[0])]
    assert set(asked) == {0}  # the group's first member only
    rest = [unit for unit, _ in walk]
    assert set(asked) == {0, 1, 2, 3} and len(rest) == 8


def test_a_single_unit_first_object_waits_for_the_next_nonempty_one_only() -> None:
    # whether its unit is the group's last depends on what follows: the next object with a unit tells
    objects, units = objects_with([1, 1, 1, 1])
    asked: list[int] = []
    walk = Sampler(lambda objs: Asked(objs, units, asked), objects, seed=1, mix=4).walk(Cursor())
    next(walk)
    assert set(asked) == {0, 1}


def test_arriving_reads_the_first_wanted_alone_then_every_other_at_once() -> None:
    objects, units = objects_with([2, 3, 1, 4])
    reads: list[str] = []

    def read(obj: RemoteObject) -> Future[Sequence[Unit]] | None:
        reads.append(obj.path)
        future: Future[Sequence[Unit]] = Future()
        future.set_result(units[obj.path])
        return future

    def take(obj: RemoteObject, future: Future[Sequence[Unit]] | None) -> Sequence[Unit]:
        assert future is not None
        return future.result()

    arriving = _Arriving(objects, read, take)
    assert reads == []  # nothing read before it is wanted
    assert arriving[0] == units["part-00"]
    assert reads == ["part-00"]
    assert arriving[2] == units["part-02"]
    assert sorted(reads) == ["part-00", "part-01", "part-02", "part-03"] and len(reads) == 4  # each read once
    assert arriving[-1] == units["part-03"] and arriving[1:3] == [units["part-01"], units["part-02"]]
    assert len(reads) == 4
    with pytest.raises(IndexError):
        arriving[4]


@pytest.fixture
def config(tmp_path: Path, make_config: Callable[..., Config]) -> Config:
    remote = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), remote, files=3, rows_per_file=40, rows_per_group=10)
    return make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "64KiB"})


@pytest.mark.usefixtures("collector_off")
def test_a_run_in_the_main_thread_freezes_the_heap_it_began_with_and_unfreezes_it(config: Config) -> None:
    garbage = dropped_cycle()
    alive: list[bool] = []

    def collect(unit: Unit) -> None:
        gc.collect(0)  # (frees the garbage, young since no collection ran, unless it is frozen)
        alive.append(garbage() is not None)

    report = SyncDaemon(config, progress=False, on_fetch=collect).run(once=True)
    assert report.units_fetched == len(alive) == 12
    assert all(alive), "the objects alive at the start (this garbage among them) are frozen"
    gc.collect()
    assert garbage() is None, "and collected again after the run"


@pytest.mark.usefixtures("collector_off")
def test_a_run_while_a_loaders_workers_run_leaves_their_heap_frozen(config: Config) -> None:
    garbage = dropped_cycle()
    with frozen_objects():  # what a loader holds from its workers' fork to its close
        SyncDaemon(config, progress=False).run(once=True)
        gc.collect(0)
        assert garbage() is not None
    gc.collect()
    assert garbage() is None


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="from 3.12 on it looks like the immortal objects")
@pytest.mark.usefixtures("collector_off")
def test_a_heap_the_program_froze_itself_before_the_run_stays_frozen(config: Config) -> None:
    garbage = dropped_cycle()
    gc.freeze()  # (the program's own, as the gc module's docs advise before forking)
    try:
        SyncDaemon(config, progress=False).run(once=True)
        gc.collect()
        assert garbage() is not None
    finally:
        gc.unfreeze()


@pytest.mark.usefixtures("collector_off")
def test_a_run_in_another_thread_leaves_the_collector_alone(config: Config) -> None:
    garbage = dropped_cycle()
    freed: list[bool] = []

    def collect(unit: Unit) -> None:
        gc.collect(0)
        freed.append(garbage() is None)

    runner = DaemonThread(SyncDaemon(config, progress=False, on_fetch=collect), once=True)
    wait_for(lambda: runner.report is not None or runner.error)
    assert runner.stop().units_fetched == len(freed) == 12
    assert all(freed)


def test_an_empty_cache_reads_one_unit_at_a_time_until_its_first_shard_is_published(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first shard's write has the machine to itself: while it is under way (held here by the
    publish hook, which runs before the write counts as done) no second read runs beside another."""
    lock = threading.Lock()
    counts = {"reading": 0, "most_before_publish": 0}
    published, widened = threading.Event(), threading.Event()
    open_source = daemon_module.open_source

    def open_counted(*args: Any) -> Any:  # instrumentation: how many reads run at once
        source = open_source(*args)
        read = source.read

        def counted_read(unit: Any) -> pa.Table:
            with lock:
                counts["reading"] += 1
                if not published.is_set():
                    counts["most_before_publish"] = max(counts["most_before_publish"], counts["reading"])
                if counts["reading"] > 1:
                    widened.set()
            try:
                return read(unit)
            finally:
                with lock:
                    counts["reading"] -= 1

        monkeypatch.setattr(source, "read", counted_read)
        return source

    def first_publish(_: Any) -> None:
        if not published.is_set():
            widened.wait(0.5)  # a window opened at hand-over would start reads now, beside the write
            published.set()

    monkeypatch.setattr(daemon_module, "open_source", open_counted)
    report = SyncDaemon(config, progress=False, on_publish=first_publish).run(once=True)
    assert report.units_published == 12
    assert counts["most_before_publish"] == 1
