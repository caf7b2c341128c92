"""LedgerWatch: a ledger version that changes with every commit by another connection, and only then."""

from __future__ import annotations

from pathlib import Path

from epochcache.cache.ledger import Ledger
from epochcache.train.ledgerwatch import LedgerWatch


def test_the_version_changes_with_a_commit_by_another_connection_only(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger")
    watch = LedgerWatch(ledger.path)
    first = watch.version()
    assert first is not None and watch.version() == first, "nothing committed: the same version"
    ledger.incr("quarantined")  # this process's ledger is another connection
    second = watch.version()
    assert second is not None and second != first
    assert watch.version() == second
    watch.close()
    ledger.close()


def test_a_ledger_that_cannot_be_opened_has_no_version(tmp_path: Path) -> None:
    watch = LedgerWatch(tmp_path / "no such folder" / "ledger.sqlite3")
    assert watch.version() is None
    watch.close()
