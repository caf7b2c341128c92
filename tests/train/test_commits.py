"""CommitMarks: the ledger's WAL-index header, unchanged exactly while no connection commits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.train.commits import CommitMarks


def test_a_mark_changes_with_every_commit_of_any_connection_and_only_then(tmp_path: Path) -> None:
    layout = CacheLayout.create(tmp_path / "cache")
    mine, other = Ledger(layout.ledger), Ledger(layout.ledger)
    marks = CommitMarks(mine.path)
    try:
        before = marks.now()
        assert before is not None and before == marks.now()
        mine.shards(), mine.db.version(), other.shards()  # reads commit nothing
        assert marks.now() == before
        lease = other.leases.snapshot("other", 60.0)  # another connection's commit
        after_other = marks.now()
        assert after_other != before
        mine.leases.release(lease.id)  # this connection's own commit (PRAGMA data_version does not see these)
        assert marks.now() not in (before, after_other)
    finally:
        marks.close()
        other.close()
        mine.close()


def test_no_wal_index_gives_no_mark(tmp_path: Path) -> None:
    marks = CommitMarks(tmp_path / "absent.sqlite3")
    assert marks.now() is None
    marks.close()


def _wal_index_locks(ledger: Ledger) -> list[str]:
    """This process's POSIX locks on the ledger's WAL index (the ``-shm`` file), from ``/proc/locks``."""
    inode = os.stat(f"{ledger.path}-shm").st_ino
    rows = map(str.split, Path("/proc/locks").read_text().splitlines())
    return [" ".join(fields[1:4] + fields[6:]) for fields in rows
            if fields[4] == str(os.getpid()) and fields[5].endswith(f":{inode}")]


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads Linux's /proc/locks")
def test_marks_leave_sqlite_its_lock_on_the_wal_index(tmp_path: Path) -> None:
    # Closing any descriptor of a file drops every POSIX lock the process holds on it: marks that
    # opened and closed the -shm file dropped SQLite's read lock, so another process took itself for
    # the first connection and truncated the WAL index under this one's (SIGBUS in SQLite).
    ledger = Ledger(CacheLayout.create(tmp_path / "cache").ledger)
    held = _wal_index_locks(ledger)
    assert held, "SQLite holds a read lock on its WAL index while a connection is open"
    for _ in range(3):
        marks = CommitMarks(ledger.path)
        assert marks.now() is not None
        marks.close()
        assert _wal_index_locks(ledger) == held
    ledger.counters.incr("written")
    assert _wal_index_locks(ledger) == held
    ledger.close()


def test_marks_open_each_wal_index_once_and_let_a_deleted_one_go(tmp_path: Path) -> None:
    layout = CacheLayout.create(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    first = CommitMarks(ledger.path)
    opened = len(os.listdir("/proc/self/fd"))
    more = [CommitMarks(ledger.path) for _ in range(20)]
    assert len(os.listdir("/proc/self/fd")) == opened, "one descriptor per -shm file, however many marks"
    for marks in more:
        marks.close()
    ledger.close()  # the last connection: SQLite deletes its -shm file
    assert not Path(f"{ledger.path}-shm").exists()
    again = Ledger(layout.ledger)
    marks = CommitMarks(again.path)  # a new -shm file; the deleted one's descriptors are closed
    assert len(os.listdir("/proc/self/fd")) <= opened + 1  # (+1: the new connection's own)
    assert first.now() is None, "marks left over on the deleted file: no mark, not an error"
    before = marks.now()
    again.counters.incr("written")
    assert marks.now() != before, "the new file's header is the one read"
    marks.close()
    again.close()
