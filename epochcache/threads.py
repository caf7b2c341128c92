"""Thread pools that never hold up the process's exit, and the exit as threads see it.

Python joins every ``ThreadPoolExecutor`` thread before it exits. Two of ours may wait on something
that only the rest of the program ends: the loader's batch thread waits for a place that only the
consumer frees (a script may end without closing its loader: after ``break``, an exception, or at
the end of a loop whose next epoch the loader had already prepared), and the daemon's publishing
thread waits for room that only training makes (a daemon run in a thread of a program that ends).
Either held the process forever. They come from :class:`DaemonThreadPool`, whose threads Python
does not wait for, and so do the loader's preparing and cleanup threads: a ``ThreadPoolExecutor``
collected tells its thread to exit, and a loader abandoned mid-epoch, collected with its pools, has
its epoch finalized into that thread (the task never ran: ``gc.collect()`` hung). Invariant: an
unclosed loader or an unstopped in-process daemon never keeps the process from exiting, and nothing
is waited for or handed to a pool once Python finalizes (:func:`interpreter_exiting`). What a thread
was doing then ends as in a crash, which both sides survive: a shard not published is never seen,
and the leases of an exited process lapse (:mod:`epochcache.cache.ledger_leases`).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

_T = TypeVar("_T")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def interpreter_exiting() -> bool:
    """True once Python is finalizing: its threads were joined and what is left (an unclosed
    loader's epoch generators, say) is being collected. (``sys.is_finalizing``: one C call, where
    asking whether the main thread is alive cost the epoch boundary ~4 µs, measured.)"""
    return sys.is_finalizing()


class DaemonThreadPool(Executor):
    """``count`` daemon threads, started on first use and kept until :meth:`shutdown`, running the
    tasks submitted in order; at interpreter exit they are left where they are, never joined."""

    def __init__(self, count: int, name: str) -> None:
        self._count, self._name = count, name
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: cannot run a task after shutdown")
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, name=f"{self._name}_{i}", daemon=True)
                                 for i in range(self._count)]
                for thread in self._threads:
                    thread.start()
            future: Future[_T] = Future()
            self._tasks.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once the tasks submitted are done (``cancel_futures``: those not started
        are cancelled); ``wait``: return once they have stopped."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            if cancel_futures:
                while True:
                    try:
                        task = self._tasks.get_nowait()
                    except queue.Empty:
                        break
                    if task is not None:
                        task[0].cancel()
            for _ in self._threads:
                self._tasks.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - not swallowed: raised by the future's result()
                future.set_exception(exc)
            del task, future, fn, args, kwargs  # nothing of a finished task is kept while waiting for the next
