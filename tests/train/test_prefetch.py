"""BatchThread: batch jobs planned and built ahead on a pool thread, built by the consumer when it waits;
in order, at most ``depth`` ahead, errors in place, fences kept."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
from conftest import wait_for

from epochcache.train.jobs import FENCE, Planned
from epochcache.train.prefetch import BatchThread


class _Counted:
    """Jobs building 0, 1, ... up to ``count``, counting what was built (and on which thread); job
    ``fail_at`` raises, and planning raises at ``plan_fails_at``; ``gates[n]`` holds job n until set."""

    def __init__(self, count: int, fail_at: int | None = None, plan_fails_at: int | None = None,
                 gates: dict[int, threading.Event] | None = None):
        self.count, self.fail_at, self.plan_fails_at, self.gates = count, fail_at, plan_fails_at, gates or {}
        self.built: list[int] = []
        self.started: set[int] = set()
        self.threads: dict[int, str] = {}

    def __iter__(self) -> Iterator[Planned]:
        for number in range(self.count):
            if number == self.plan_fails_at:
                raise OSError(f"batch {number} cannot be planned")
            yield partial(self._build, number)

    def _build(self, number: int) -> int:
        self.started.add(number)
        if number in self.gates:
            assert self.gates[number].wait(10)
        if number == self.fail_at:
            raise ValueError(f"batch {number} cannot be built")
        self.threads[number] = threading.current_thread().name
        self.built.append(number)
        return number


def test_batches_come_in_order_and_at_most_depth_ahead() -> None:
    source = _Counted(50)
    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(source, 3, pool)
        wait_for(lambda: len(source.built) == 4, timeout=10)  # 3 ahead and the one the consumer will hold
        assert next(thread) == 0
        assert next(thread) == 1  # back from batch 0: its place is free
        wait_for(lambda: len(source.built) == 5, timeout=10)
        assert len(source.built) == 5, "one place freed, one more batch: never further ahead"
        assert list(thread) == list(range(2, 50))
        assert sorted(source.built) == list(range(50)), "each batch built once"
        with pytest.raises(StopIteration):
            next(thread)
        thread.close()


def test_the_consumer_builds_what_nobody_has_claimed_and_helps_while_the_thread_builds() -> None:
    gate = threading.Event()
    source = _Counted(6, gates={0: gate})
    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(source, 2, pool)
        wait_for(lambda: 0 in source.started, timeout=10)  # the thread builds batch 0 (and waits in it)
        # batch 0 is the thread's: the consumer builds batch 1 meanwhile; once it has, batch 0 may finish
        releaser = threading.Thread(target=lambda: (wait_for(lambda: 1 in source.built, timeout=10), gate.set()))
        releaser.start()
        assert next(thread) == 0
        releaser.join()
        assert source.threads[1] == threading.current_thread().name, "built by the consumer while it waited"
        assert source.threads[0] != threading.current_thread().name
        assert list(thread) == [1, 2, 3, 4, 5]
        assert sorted(source.built) == list(range(6)), "each batch built once, whoever built it"
        thread.close()


@pytest.mark.parametrize("where", ["build", "plan"])
def test_an_error_is_raised_at_the_batch_that_failed(where: str) -> None:
    source = _Counted(10, fail_at=2) if where == "build" else _Counted(10, plan_fails_at=2)
    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(source, 4, pool)
        assert [next(thread), next(thread)] == [0, 1]
        with pytest.raises(ValueError if where == "build" else OSError, match="batch 2"):
            next(thread)
        thread.close()


def test_nothing_after_a_fence_is_planned_until_every_job_before_it_is_built() -> None:
    # The thread builds batch 0 (held at its gate); the consumer, waiting for it, builds batch 1 (held
    # at its gate): planning past the fence must wait for batch 1 too, though the thread did not claim it.
    gates = {0: threading.Event(), 1: threading.Event()}
    source = _Counted(2, gates=gates)
    after: list[list[int]] = []
    planned_past = threading.Event()

    def jobs() -> Iterator[Planned]:
        yield from source
        yield FENCE
        after.append(sorted(source.built))  # what was built when planning went on
        planned_past.set()
        yield lambda: 2

    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(jobs(), 4, pool)
        wait_for(lambda: 0 in source.started, timeout=10)

        def release() -> None:
            wait_for(lambda: 1 in source.started, timeout=10)  # the consumer is in batch 1
            gates[0].set()
            assert not planned_past.wait(0.3), "planned past the fence while batch 1 was being built"
            gates[1].set()

        releaser = threading.Thread(target=release)
        releaser.start()
        assert list(thread) == [0, 1, 2]
        releaser.join()
        assert after == [[0, 1]]
        thread.close()


def test_close_stops_a_thread_waiting_for_a_place() -> None:
    source = _Counted(1000)
    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(source, 2, pool)
        wait_for(lambda: len(source.built) == 3, timeout=10)
        thread.close()  # returns: the waiting thread is woken and stops
        assert len(source.built) == 3
        assert pool.submit(lambda: "free").result(timeout=10) == "free", "the pool's thread is free again"
