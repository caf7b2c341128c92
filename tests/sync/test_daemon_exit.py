"""A daemon run in a thread of a program that ends does not hold the program up.

Before: its publishing thread, a ``ThreadPoolExecutor``'s, waited for room that only training makes
(the budget full of shards no epoch had used), and Python joined it at exit: the program hung."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pytest
from conftest import write_parquet_dataset

_PROGRAM = textwrap.dedent("""
    import sys, threading
    from epochcache import Ledger, SyncDaemon, load_config
    from epochcache.cache.layout import CacheLayout
    from conftest import wait_for
    config = load_config(None, {"source.url": sys.argv[1], "cache.dir": sys.argv[2],
                                "cache.max_bytes": "1MB", "cache.shard_bytes": "64KiB"})
    threading.Thread(target=SyncDaemon(config, progress=False).run, daemon=True).start()
    ledger = Ledger(CacheLayout.create(sys.argv[2]).ledger)
    wait_for(lambda: (ledger.daemon.status() or {}).get("state") == "waiting for training", timeout=60)
    print("waiting for training", flush=True)
""")


@pytest.mark.slow  # (a program's process: 2 s)
def test_a_program_running_a_daemon_in_a_thread_exits_while_it_waits_for_room(tmp_path: Path) -> None:
    remote = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), remote, files=24, rows_per_file=128, rows_per_group=32)
    tests = str(Path(__file__).parents[1])
    done = subprocess.run([sys.executable, "-c", _PROGRAM, remote, str(tmp_path / "cache")], capture_output=True,
                          text=True, timeout=120, cwd=tests, env={**os.environ, "PYTHONPATH": tests})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "waiting for training"
