"""CommitMarks: the ledger's WAL-index header, unchanged exactly while no connection commits."""

from __future__ import annotations

from pathlib import Path

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
