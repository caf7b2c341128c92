"""DaemonThreadPool: an Executor whose threads never hold up the exit (see epochcache.threads)."""

from __future__ import annotations

import threading

import pytest

from epochcache.threads import DaemonThreadPool, interpreter_exiting


def test_tasks_run_on_daemon_threads_started_on_first_use_and_results_and_errors_reach_the_future() -> None:
    pool = DaemonThreadPool(2, "t-pool")
    assert not [t for t in threading.enumerate() if t.name.startswith("t-pool")], "no thread before a task"
    assert pool.submit(lambda x: x * 2, 21).result(timeout=10) == 42
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 // 0).result(timeout=10)
    threads = [t for t in threading.enumerate() if t.name.startswith("t-pool")]
    assert len(threads) == 2 and all(t.daemon for t in threads)
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)


def test_shutdown_cancels_the_tasks_not_started_when_asked() -> None:
    pool = DaemonThreadPool(1, "t-cancel")
    started, release = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return release.wait(10)

    running = pool.submit(hold)
    queued = pool.submit(lambda: "ran")
    assert started.wait(10)
    pool.shutdown(wait=False, cancel_futures=True)
    release.set()
    assert running.result(timeout=10) is True and queued.cancelled()


def test_the_interpreter_is_not_finalizing_while_tests_run() -> None:
    assert interpreter_exiting() is False
