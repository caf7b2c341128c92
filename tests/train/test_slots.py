"""Worker batches through shared-memory slots: same batches as the pipe, no slot overwritten while held."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import ITEM_SHAPE

from epochcache import EpochCachedLoader
from epochcache.config import Config
from epochcache.train.slots import SlotBatch, SlotRing, layout_of, shared_memory
from epochcache.train.wire import to_wire

LAYOUT = {"image": (np.dtype(np.uint8), ITEM_SHAPE), "id": (np.dtype(np.int64), ())}


def _batch(ids: list[int]) -> dict[str, torch.Tensor]:
    id_tensor = torch.tensor(ids, dtype=torch.int64)
    image = (id_tensor % 251).to(torch.uint8)[:, None, None, None].expand(-1, *ITEM_SHAPE).contiguous()
    return {"image": image, "id": id_tensor}


def test_batch_round_trips_through_its_slot_with_extra_columns() -> None:
    ring = SlotRing(LAYOUT, batch_size=4, count=3)
    message = ring.send(0, {**_batch([5, 6, 7]), "name": ["a", "b", "c"]})
    assert isinstance(message, SlotBatch) and (message.number, message.rows) == (0, 3)
    batch = ring.receive(message, 0)
    assert torch.equal(batch["id"], torch.tensor([5, 6, 7])) and torch.equal(batch["image"], _batch([5, 6, 7])["image"])
    assert batch["name"] == ["a", "b", "c"]


def test_slot_is_not_written_again_until_its_batch_is_received() -> None:
    ring = SlotRing(LAYOUT, batch_size=2, count=2)
    held = ring.send(0, _batch([1, 2]))
    assert ring.send(1, _batch([3, 4])) is not None, "another slot is free"
    assert ring.send(2, _batch([9, 9])) is None, "slot 0 still holds batch 0: batch 2 must take the pipe"
    assert ring.claim(2) is None
    first = ring.receive(held, 0)
    assert ring.send(2, _batch([5, 6])) is not None, "received: slot 0 is free for batch 2"
    assert torch.equal(first["id"], torch.tensor([1, 2])), "a received batch is a copy the ring does not reuse"


def test_a_batch_that_took_the_pipe_passes_its_slot_on_to_the_batch_after() -> None:
    ring = SlotRing(LAYOUT, batch_size=2, count=2)
    held = ring.send(0, _batch([1, 2]))
    assert ring.send(2, _batch([5, 6])) is None, "slot 0 still holds batch 0: batch 2 takes the pipe"
    ring.receive(held, 0)
    assert torch.equal(ring.receive(to_wire(_batch([5, 6])), 2)["id"], torch.tensor([5, 6])), "unwrapped"
    assert ring.send(4, _batch([7, 8])) is not None, "slot 0 waits for batch 4 now, not for batch 2 for ever"


def test_layout_of_a_batch_keeps_the_numeric_cpu_columns_with_the_first_ones_rows() -> None:
    batch = {
        "names": ["a", "b"], "array": np.arange(2), "scalar": torch.tensor(1.0),
        "image": torch.zeros(2, 3, 4, dtype=torch.uint8), "id": torch.arange(2),
        "flags": torch.ones(2, dtype=torch.bool), "other_rows": torch.zeros(5, 2),
        "half": torch.zeros(2, dtype=torch.bfloat16),
        "grad": torch.zeros(2, requires_grad=True),
    }
    assert layout_of(batch) == {"image": (np.dtype(np.uint8), (3, 4)), "id": (np.dtype(np.int64), ()),
                                "flags": (np.dtype(np.bool_), ())}
    assert layout_of([1, 2]) == {} and layout_of({"names": ["a"]}) == {}
    ring = SlotRing(layout_of(batch), batch_size=2, count=2)
    message = ring.send(0, batch)
    assert message is not None, "a batch fits the layout made of it"
    received = ring.receive(pickle.loads(pickle.dumps(message)), 0)
    assert isinstance(received["array"], np.ndarray) and received["half"].dtype == torch.bfloat16
    assert received["grad"].requires_grad and received["names"] == ["a", "b"], "the rest arrives as it was made"


def test_ring_of_a_resumed_epoch_starts_at_its_first_batch() -> None:
    ring = SlotRing(LAYOUT, batch_size=2, count=3, first=7)
    assert [ring.claim(n) is not None for n in (7, 8, 9, 10)] == [True, True, True, False]


def test_batches_that_do_not_fit_are_refused() -> None:
    ring = SlotRing(LAYOUT, batch_size=2, count=2)
    assert ring.send(0, _batch([1, 2, 3])) is None, "more rows than a slot holds"
    assert ring.send(0, {**_batch([1, 2]), "image": _batch([1, 2])["image"].float()}) is None, "another dtype"
    assert ring.send(0, {"id": torch.tensor([1, 2])}) is None, "a slot column is missing"
    assert ring.send(0, [1, 2]) is None, "not a dict"
    assert ring.send(0, _batch([1, 2])) is not None, "refusals left the slot free"


@pytest.fixture
def synced(synced_cache: Callable[..., Config]) -> Config:
    return synced_cache(files=3, rows_per_file=200, rows_per_group=50, shard_bytes="128KiB")


def _epochs(config: Config, epochs: int, **kwargs: object) -> list[list[dict[str, torch.Tensor]]]:
    with EpochCachedLoader(config.cache.dir, batch_size=32, seed=5, progress=False, **kwargs) as loader:
        return [list(loader) for _ in range(epochs)]


def _to_float(batch: dict) -> dict:
    return {**batch, "image": batch["image"].float()}


@pytest.fixture
def messages(monkeypatch: pytest.MonkeyPatch) -> list[type]:
    """The type of each message a trainer's slot ring receives: SlotBatch through a slot, else the pipe's."""
    kinds: list[type] = []
    receive = SlotRing.receive
    monkeypatch.setattr(SlotRing, "receive", lambda ring, message, number, pinned=False:
                        kinds.append(type(message)) or receive(ring, message, number, pinned))
    return kinds


@pytest.mark.parametrize("transform", [None, _to_float], ids=["slots", "slots-learned-from-a-transform"])
def test_worker_batches_equal_the_in_process_batches(
    synced: Config, transform: Callable | None, messages: list[type]
) -> None:
    expected = _epochs(synced, 2, num_workers=0, transform=transform)
    got = _epochs(synced, 2, num_workers=2, transform=transform)
    # the ring and the prefetch depth are sized so that no batch waits for a slot: none takes the pipe
    # (a third epoch queued in time had its first batch received too, ahead of the end of the second)
    if transform is None:
        assert set(messages) == {SlotBatch} and len(messages) >= 2 * len(got[0])
    else:  # the ring, sized after the transform's first batch (received through the pipe), carries the rest
        pipe = [number for number, kind in enumerate(messages) if kind is dict]
        assert pipe and len(pipe) <= 8 and set(messages[len(got[0]):]) == {SlotBatch}, messages
    assert [len(e) for e in got] == [len(e) for e in expected] and len(expected[0]) == -(-600 // 32)
    for got_epoch, expected_epoch in zip(got, expected):
        for a, b in zip(got_epoch, expected_epoch):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    # every batch is still intact after later batches went through the same slots
    for epoch in got:
        for batch in epoch:
            pixels = (batch["id"] % 251).to(batch["image"].dtype)[:, None, None, None].expand(-1, *ITEM_SHAPE)
            assert torch.equal(batch["image"], pixels)


def _ragged(batch: dict) -> dict:
    """A transform whose output changes shape from batch to batch (a crop as wide as id % 4 + 1)."""
    width = int(batch["id"][0]) % 4 + 1
    return {**batch, "image": batch["image"][..., :width].contiguous(), "name": [str(int(i)) for i in batch["id"]]}


def test_a_transform_whose_shapes_change_still_delivers_every_batch_intact(synced: Config) -> None:
    expected = _epochs(synced, 2, num_workers=0, transform=_ragged)
    got = _epochs(synced, 2, num_workers=2, transform=_ragged)  # (the ring fits some batches, the pipe the rest)
    assert [len(e) for e in got] == [len(e) for e in expected]
    for got_epoch, expected_epoch in zip(got, expected):
        for a, b in zip(got_epoch, expected_epoch):
            assert a["name"] == b["name"] and torch.equal(a["id"], b["id"]) and torch.equal(a["image"], b["image"])
    assert len({batch["image"].shape[-1] for epoch in got for batch in epoch}) > 1


def _doubled(batch: dict) -> dict:
    """A transform making more rows than it got (each sample twice, as a two-view augmentation would)."""
    return {name: torch.cat([value, value]) for name, value in batch.items()}


def test_a_transform_that_makes_more_rows_than_a_batch_has_them_carried_by_the_slots(
    synced: Config, messages: list[type]
) -> None:
    expected = _epochs(synced, 2, num_workers=0, transform=_doubled)
    got = _epochs(synced, 2, num_workers=2, transform=_doubled)
    assert len(got[0][0]["id"]) == 64 and set(messages[len(got[0]):]) == {SlotBatch}
    assert all(torch.equal(a[k], b[k]) for ge, ee in zip(got, expected) for a, b in zip(ge, ee) for k in a)


def _mixed(batch: dict) -> dict:
    """A transform making what the slots cannot carry: bfloat16 (numpy lacks it) and a numpy array."""
    return {"image": batch["image"].to(torch.bfloat16), "id": batch["id"].numpy().copy()}


def test_a_transforms_bfloat16_tensors_and_numpy_arrays_arrive_from_workers_as_made(synced: Config) -> None:
    expected = _epochs(synced, 1, num_workers=0, transform=_mixed)[0]
    got = _epochs(synced, 1, num_workers=2, transform=_mixed)[0]
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a["image"].dtype == torch.bfloat16 and torch.equal(a["image"], b["image"])
        assert isinstance(a["id"], np.ndarray) and np.array_equal(a["id"], b["id"])


def test_ring_in_shared_memory_pickles_to_the_same_slots_without_resetting_them() -> None:
    fd = shared_memory()
    try:
        ring = SlotRing(LAYOUT, batch_size=2, count=2, fd=fd)
        held = ring.send(0, _batch([1, 2]))
        attached = pickle.loads(pickle.dumps(ring))  # what a worker forked after shared_memory() receives
        assert attached.claim(2) is None, "batch 0 is unread: the attached ring must not free its slot"
        message = attached.send(1, _batch([3, 4]))
        assert message is not None and torch.equal(ring.receive(message, 1)["id"], torch.tensor([3, 4]))
        assert torch.equal(ring.receive(held, 0)["id"], torch.tensor([1, 2]))
        assert attached.claim(2) is not None, "the trainer's receive freed the slot for both"
    finally:
        os.close(fd)


def test_ring_in_memory_of_its_own_refuses_to_pickle() -> None:
    with pytest.raises(TypeError, match="shared_memory"):
        pickle.dumps(SlotRing(LAYOUT, batch_size=2, count=2))
