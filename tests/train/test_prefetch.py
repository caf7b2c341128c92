"""BatchThread: batches built ahead on a pool thread, in order, at most ``depth`` ahead, errors in place."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import wait_for

from epochcache.train.prefetch import BatchThread


class _Counted:
    """Yields 0, 1, ... up to ``count``, counting what it has built; raises at ``fail_at``."""

    def __init__(self, count: int, fail_at: int | None = None):
        self.count, self.fail_at, self.built = count, fail_at, 0

    def __iter__(self) -> Iterator[int]:
        for number in range(self.count):
            if number == self.fail_at:
                raise ValueError(f"batch {number} cannot be built")
            self.built += 1
            yield number


def test_batches_come_in_order_and_at_most_depth_ahead() -> None:
    source = _Counted(50)
    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(source, 3, pool)
        wait_for(lambda: source.built == 5, timeout=10)  # 3 queued, one for the consumer, one more waiting
        assert next(thread) == 0
        assert next(thread) == 1  # back from batch 0: its place is free
        wait_for(lambda: source.built == 6, timeout=10)
        assert source.built == 6, "one place freed, one more batch: never further ahead"
        assert list(thread) == list(range(2, 50))
        with pytest.raises(StopIteration):
            next(thread)
        thread.close()


def test_an_error_is_raised_at_the_batch_that_failed() -> None:
    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(_Counted(10, fail_at=2), 4, pool)
        assert [next(thread), next(thread)] == [0, 1]
        with pytest.raises(ValueError, match="batch 2"):
            next(thread)
        thread.close()


def test_close_stops_a_thread_waiting_to_hand_over_a_batch() -> None:
    source = _Counted(1000)
    with ThreadPoolExecutor(1) as pool:
        thread = BatchThread(source, 2, pool)
        wait_for(lambda: source.built == 4, timeout=10)
        thread.close()  # returns: the waiting thread is woken and stops
        assert source.built == 4
        assert pool.submit(lambda: "free").result(timeout=10) == "free", "the pool's thread is free again"
