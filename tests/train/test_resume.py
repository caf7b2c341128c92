"""Resume: state_dict()/load_state_dict() continue mid-epoch with exactly the unseen batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from epochcache import EpochCachedLoader, Ledger, LoaderError
from epochcache.cache.layout import CacheLayout
from epochcache.config import Config


@pytest.fixture
def synced(synced_cache: Callable[..., Config]) -> Config:
    return synced_cache(files=4, rows_per_file=100, rows_per_group=25, shard_bytes="64KiB")


def _batches(loader: EpochCachedLoader, stop_after: int | None = None) -> list[list[int]]:
    """One epoch's batches as id lists; with ``stop_after``, break out after that many."""
    seen = []
    for batch in loader:
        seen.append(batch["id"].tolist())
        if len(seen) == stop_after:
            break
    return seen


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_unseen_batches_twice_over(synced: Config, workers: int) -> None:
    kwargs = {"batch_size": 16, "seed": 7, "num_workers": workers}
    with EpochCachedLoader(synced.cache.dir, **kwargs) as reference:
        epoch0, epoch1 = _batches(reference), _batches(reference)
    with EpochCachedLoader(synced.cache.dir, **kwargs) as first:
        assert _batches(first, stop_after=5) == epoch0[:5]
        state = first.state_dict()
    assert (state["epoch"], state["position"], state["seed"]) == (0, 5, 7)
    with EpochCachedLoader(synced.cache.dir, **{**kwargs, "seed": 0}) as second:  # the state carries the seed
        second.load_state_dict(state)
        assert second.state_dict() == state, "a loaded state is what it saves until the epoch runs"
        assert _batches(second, stop_after=3) == epoch0[5:8]
        state = second.state_dict()
    assert state["position"] == 8
    with EpochCachedLoader(synced.cache.dir, **kwargs) as third:
        third.load_state_dict(state)
        assert _batches(third) == epoch0[8:], "the rest of epoch 0, nothing replayed, nothing lost"
        assert third.last_epoch.start_batch == 8
        assert third.state_dict() == {"epoch": 1, "position": 0, "seed": 7, "shards": None, "snapshot": None}
        assert _batches(third) == epoch1


def test_resume_when_the_snapshot_shards_are_gone_is_a_clear_error(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=16) as first:
        _batches(first, stop_after=2)
        state = first.state_dict()
    ledger = Ledger(CacheLayout(Path(synced.cache.dir)).ledger)
    gone = next(r for r in ledger.shards() if r.id == state["shards"][0])
    ledger.drop([gone.id])
    ledger.close()
    with EpochCachedLoader(synced.cache.dir, batch_size=16) as second:
        second.load_state_dict(state)
        with pytest.raises(LoaderError, match=r"cannot resume epoch 0 at batch 2: 1 of its \d+ shards"):
            next(iter(second))
        # the documented fallback in the message: the next epoch, from a fresh snapshot
        second.load_state_dict({**state, "epoch": 1, "position": 0, "shards": None, "snapshot": None})
        assert sum(len(b) for b in _batches(second)) == 400 - gone.rows


def test_a_tampered_or_partial_state_is_refused(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=16) as loader:
        _batches(loader, stop_after=1)
        state = loader.state_dict()
        with pytest.raises(LoaderError, match="does not match"):
            loader.load_state_dict({**state, "shards": state["shards"][1:]})
        with pytest.raises(LoaderError, match="lacks"):
            loader.load_state_dict({"epoch": 0})
