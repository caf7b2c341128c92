"""torch.distributed under stress: real ranks (processes on 127.0.0.1, gloo, torchrun's environment;
see ``dist_launch.py``) on caches filled by the real daemon.

Uneven worlds (1 node x 3 ranks, 3 nodes x 1 rank of different sizes), ``drop_last`` both ways,
``epoch_samples``, worker processes; a rank killed mid-epoch or before its loader; a late rank;
resume under distributed. Every rank must get the same number of batches (DDP hangs otherwise),
the ranks of a node disjoint parts, and the node's whole snapshot covered but for what the README
says is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from conftest import write_parquet_dataset
from dist_launch import launch

from epochcache import EpochCachedLoader, SyncDaemon
from epochcache.config import load_config

BATCH = 16


@pytest.fixture
def node_cache(tmp_path: Path) -> Callable[[str, int, int], str]:
    """A cache dir synced (``sync --once``) from its own local remote of ``files`` x ``rows``, ids from 0."""

    def build(name: str, files: int, rows: int) -> str:
        remote = str(tmp_path / f"remote-{name}")
        write_parquet_dataset(fsspec.filesystem("file"), remote, files, rows, 25)
        cache = str(tmp_path / f"cache-{name}")
        SyncDaemon(load_config(None, {"source.url": remote, "cache.dir": cache, "cache.max_bytes": "20MB",
                                      "cache.shard_bytes": "64KiB"}), progress=False).run(once=True)
        return cache

    return build


def _run(tmp_path: Path, name: str, caches: list[str], per_node: int, loader: dict[str, Any], epochs: int = 2,
         **plan: Any) -> dict[int, Any]:
    plan = {"caches": {str(n): c for n, c in enumerate(caches)}, "loader": loader, "epochs": epochs, **plan}
    return launch(plan, len(caches), per_node, tmp_path / name)


def _ok(records: dict[int, Any]) -> None:
    failed = {r: rec.get("error") or rec for r, rec in records.items() if "epochs" not in rec or "error" in rec}
    assert not failed, failed


def _seen(record: dict[str, Any], epoch: int) -> list[int]:
    return [i for batch in record["epochs"][epoch]["ids"] for i in batch]


# 303 samples on one node of 3 ranks, batches of 16: 101 per rank, 6 full batches and one of 5.
# drop_last: 6 batches of 16 per rank, 15 samples left out. epoch_samples=97: 2 whole rounds of
# 3 x 16 and one sample over, which no rank can take without the others getting a batch fewer: the
# README says such a remainder (fewer samples than ranks) is left out.
@pytest.mark.parametrize(("loader", "batches", "seen"), [
    pytest.param({}, 7, 303, marks=pytest.mark.slow), pytest.param({"drop_last": True}, 6, 288, marks=pytest.mark.slow),
    pytest.param({"epoch_samples": 97}, 2, 96, marks=pytest.mark.slow),
    pytest.param({"num_workers": 2}, 7, 303, marks=pytest.mark.slow),
], ids=["plain", "drop_last", "epoch_samples", "workers"])
def test_one_node_three_ranks_equal_batches_disjoint_parts_whole_snapshot(
    tmp_path: Path, node_cache: Callable[[str, int, int], str], loader: dict[str, Any], batches: int, seen: int,
) -> None:
    cache = node_cache("a", 3, 101)
    records = _run(tmp_path, "run", [cache], 3, {"batch_size": BATCH, **loader},
                   transform="num_workers" in loader)
    _ok(records)
    for epoch in range(2):
        assert {len(records[r]["epochs"][epoch]["ids"]) for r in range(3)} == {batches}
        parts = [_seen(records[r], epoch) for r in range(3)]
        every = [i for part in parts for i in part]
        assert len(every) == len(set(every)) == seen, "disjoint parts, each sample at most once"
        assert set(every) <= set(range(303))
        assert len({records[r]["epochs"][epoch]["snapshot"] for r in range(3)}) == 1
    assert _seen(records[0], 0) != _seen(records[0], 1), "each epoch draws a new order"


@pytest.mark.slow
def test_three_nodes_of_one_rank_and_different_sizes_stop_together(
    tmp_path: Path, node_cache: Callable[[str, int, int], str],
) -> None:
    caches = [node_cache("a", 3, 101), node_cache("b", 2, 100), node_cache("c", 1, 90)]
    for drop_last, batches in ((False, 6), (True, 5)):
        records = _run(tmp_path, f"run{drop_last}", caches, 1, {"batch_size": BATCH, "drop_last": drop_last}, 1)
        _ok(records)
        # the smallest node's 90 samples make 6 batches (5 with drop_last): the larger nodes stop there too
        assert [len(records[r]["epochs"][0]["ids"]) for r in range(3)] == [batches] * 3
        assert len(set(_seen(records[2], 0))) == (90 if not drop_last else 80)
        assert all(len(set(_seen(records[r], 0))) == batches * BATCH for r in (0, 1))


@pytest.mark.slow  # (3 rank processes: 5-7 s)
def test_a_rank_killed_mid_epoch_fails_the_others_at_once_with_a_loader_error(
    tmp_path: Path, node_cache: Callable[[str, int, int], str],
) -> None:
    records = _run(tmp_path, "run", [node_cache("a", 3, 101)], 3, {"batch_size": BATCH}, 3, kill_at=[1, 0, 2])
    assert records[1]["exit"] == -9
    for rank in (0, 2):
        assert records[rank]["error"].startswith(f"LoaderError: rank {rank} of 3: "), records[rank]
        assert "a rank exited, hung, or stopped calling its loader" in records[rank]["error"]
        assert records[rank]["seconds"] < 30, "gloo sees the dead peer's closed connection: no timeout waited"


@pytest.mark.slow  # (several seconds: run by .ci/run, out of plain pytest's 3 minutes)
def test_a_rank_that_dies_before_its_loader_fails_the_others_within_the_jobs_timeout(
    tmp_path: Path, node_cache: Callable[[str, int, int], str],
) -> None:
    """The loader's group waits as long as init_process_group's timeout (2 s here), not torch's
    default 30 minutes for a new group: the old code hung here until the launch's timeout."""
    records = _run(tmp_path, "run", [node_cache("a", 1, 50)], 3, {"batch_size": BATCH}, 1, kill_at=[2, -1, 0],
                   timeout_s=2)
    assert records[2]["exit"] == -9
    for rank in (0, 1):
        assert "forming the loader's gloo group failed" in records[rank]["error"], records[rank]
        assert "timeout, 2s here" in records[rank]["error"]


@pytest.mark.slow
def test_a_rank_that_builds_its_loader_late_is_waited_for(
    tmp_path: Path, node_cache: Callable[[str, int, int], str],
) -> None:
    records = _run(tmp_path, "run", [node_cache("a", 1, 90)], 2, {"batch_size": BATCH}, 1, late_s={"1": 3})
    _ok(records)
    assert [len(records[r]["epochs"][0]["ids"]) for r in range(2)] == [3, 3]
    assert records[0]["seconds"] > 2.5, "rank 0 waited for the late rank's loader"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_each_rank_resumes_exactly_its_unseen_batches(
    tmp_path: Path, node_cache: Callable[[str, int, int], str], workers: int,
) -> None:
    cache, loader = node_cache("a", 3, 101), {"batch_size": BATCH, "seed": 3, "num_workers": workers}
    reference = _run(tmp_path, "reference", [cache], 3, loader, 2, transform=bool(workers))
    first = _run(tmp_path, "first", [cache], 3, loader, 1, stop_after=3, transform=bool(workers))
    second = _run(tmp_path, "second", [cache], 3, loader, 2, resume=str(tmp_path / "first"),
                  transform=bool(workers))
    for records in (reference, first, second):
        _ok(records)
    for rank in range(3):
        whole = reference[rank]["epochs"]
        assert first[rank]["epochs"][0]["ids"] == whole[0]["ids"][:3]
        assert second[rank]["epochs"][0]["ids"] == whole[0]["ids"][3:], "the rest of epoch 0, nothing replayed"
        assert second[rank]["epochs"][1]["ids"] == whole[1]["ids"]


@pytest.mark.slow  # (several seconds: run by .ci/run, out of plain pytest's 3 minutes)
def test_ranks_resuming_at_different_batches_are_refused_on_every_rank(
    tmp_path: Path, node_cache: Callable[[str, int, int], str],
) -> None:
    cache, states = node_cache("a", 2, 100), tmp_path / "states"
    states.mkdir()
    with EpochCachedLoader(cache, batch_size=BATCH, progress=False) as alone:  # the node's snapshot: every shard
        for number, _ in enumerate(alone, start=1):
            if number == 3:
                break
        state = alone.state_dict()
    torch.save(state, states / "state0.pt")
    torch.save({**state, "position": 2}, states / "state1.pt")  # rank 1 resumes a batch earlier
    records = _run(tmp_path, "run", [cache], 2, {"batch_size": BATCH}, 1, resume=str(states))
    for rank in (0, 1):
        assert "rank 0: epoch 0 from batch 3, rank 1: epoch 0 from batch 2" in records[rank].get("error", ""), \
            records[rank]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_leaving_each_epoch_early_after_preparing_the_next_at_different_points(
    tmp_path: Path, node_cache: Callable[[str, int, int], str], workers: int,
) -> None:
    """Rank 0 prepares the next epoch at its 2nd batch (so its prepared epoch outlives the left one),
    rank 1 at its last (never, as it leaves at the 5th): each agreement still pairs with the other's."""
    records = _run(tmp_path, "run", [node_cache("a", 3, 101)], 2, {"batch_size": BATCH, "num_workers": workers}, 3,
                   transform=bool(workers), leave_after=5,
                   loader_by_rank={"0": {"prepare_next_at": 0.3}, "1": {"prepare_next_at": 1.0}})
    _ok(records)
    for epoch in range(3):
        assert [len(records[r]["epochs"][epoch]["ids"]) for r in range(2)] == [5, 5]
        assert not set(_seen(records[0], epoch)) & set(_seen(records[1], epoch))


@pytest.mark.slow  # (rank processes: 4-6 s)
def test_a_shard_quarantined_on_one_node_rebuilds_the_prepared_epoch_on_every_rank(
    tmp_path: Path, node_cache: Callable[[str, int, int], str],
) -> None:
    """Node 0's rank quarantines a shard after both nodes prepared epoch 1 ahead: node 0 must build it
    again, and so must node 1, or node 0's agreements would pair with node 1's next epoch's (the old
    code: a LoaderError, ranks disagreeing on the epoch, or a hang)."""
    caches = [node_cache("a", 2, 100), node_cache("b", 2, 100)]
    records = _run(tmp_path, "run", caches, 1, {"batch_size": BATCH, "prepare_next_at": 0.1}, 3,
                   quarantine_at=[0, 0, 4])
    _ok(records)
    for epoch in range(3):
        assert [len(records[r]["epochs"][epoch]["ids"]) for r in (0, 1)] == [records[0]["epochs"][epoch]["batches"]] * 2
    assert [e["ahead"] for e in records[0]["epochs"]] == [False, False, True], "epoch 1 was built again"
    assert records[1]["epochs"][1]["ahead"] is False, "on node 1 too"
    assert records[0]["epochs"][1]["snapshot"] != records[0]["epochs"][0]["snapshot"], "without the shard"
