"""In-process batches built ahead on a background thread.

In: a dataset with ``__getitems__``, a batch sampler and a thread pool; out: the batches, in order,
at most ``depth`` built ahead of the consumer. The gather is numpy/Arrow work that releases the GIL,
so it overlaps with the training step without worker processes. An exception in the thread is raised
in the consumer, at the batch where it happened.

The thread comes from a pool that outlives the epoch: a thread that ends stalled the consumer for
~10 ms here (measured on each epoch's last batch), right at the epoch boundary. (Two threads per
epoch, each building every other batch, measured no faster on 2 cores, so there is one.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from typing import Any

_POLL_S = 0.1
_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class BatchThread:
    """Iterator over ``build(indices)`` for each ``indices`` of ``sampler``; starts building at once,
    as a task of ``pool`` (which must have a thread free for it)."""

    def __init__(self, build: Callable[[Any], Any], sampler: Iterable[Any], depth: int, pool: Executor):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # Held until close: dropping the dataset behind ``build`` unmaps its shards, and a large
        # munmap blocks every page fault of the process (~10 ms here), so it must not happen when
        # the last batch is built but off the boundary, where the loader closes the epoch.
        self._build: Callable[[Any], Any] | None = build
        self._task = pool.submit(self._run, build, sampler)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)  # later calls stop too
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.exc
        return item

    def close(self) -> None:
        """Stop building and wait for the task; batches not yet taken are dropped."""
        self._stop.set()
        self._task.result()
        self._build = None

    def _run(self, build: Callable[[Any], Any], sampler: Iterable[Any]) -> None:
        try:
            for indices in sampler:
                if not self._put(build(indices)):
                    return
        except Exception as exc:  # noqa: BLE001 - not swallowed: the consumer raises it at this batch
            self._put(_Failure(exc))
            return
        self._put(_DONE)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False
