"""One process's connection to a cache's ledger database, and the statements its parts share.

In: the database's path and a ``connect`` factory (tests inject one whose writes fail with a full
disk). Out: transactions (:meth:`LedgerDatabase.write`: ``BEGIN IMMEDIATE``, all of it or nothing;
:meth:`LedgerDatabase.read`: a consistent view that blocks no writer, WAL), the ``kv`` values and
counters read and written inside them, and :meth:`LedgerDatabase.version`, a probe of other
connections' commits.

Invariant: one connection per process, shared by its threads under one lock; a forked child opens
its own (a SQLite connection must not cross a fork). Errors come out as
:class:`epochcache.errors.LedgerError` lines (:func:`epochcache.cache.ledger_schema.readable_errors`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from epochcache.cache.ledger_schema import Connect, open_database, readable_errors
from epochcache.errors import LedgerError

# The ledger databases this process has open (resolved path -> how many): a rebuild must not delete
# one from under this process either, and the lock it tests (ledger_schema.open_elsewhere) cannot
# show this process's own connections.
_OPEN_HERE: Counter[str] = Counter()
_OPEN_HERE_LOCK = threading.Lock()


def open_here(path: Path) -> bool:
    """Whether this process has a :class:`LedgerDatabase` on ``path`` open."""
    with _OPEN_HERE_LOCK:
        return _OPEN_HERE[str(path.resolve())] > 0


class LedgerDatabase:
    """The ledger database at ``path``, opened (created or upgraded) at once."""

    def __init__(self, path: Path, connect: Connect) -> None:
        self.path = path
        self._connect = connect
        self._lock = threading.RLock()
        self._con = self._open()
        self._pid = os.getpid()
        self._key: str | None = str(path.resolve())
        with _OPEN_HERE_LOCK:
            _OPEN_HERE[self._key] += 1

    def connection(self) -> sqlite3.Connection:
        """This process's connection (use it inside :meth:`read` or :meth:`write`)."""
        if os.getpid() != self._pid:  # a forked child must not use its parent's SQLite connection
            self._con = self._open()
            self._pid = os.getpid()
        return self._con

    def _open(self) -> sqlite3.Connection:
        """A connection to the database, with :func:`unit_hash` as an SQL function of the same name."""
        con = open_database(self.path, self._connect)
        con.create_function("unit_hash", 1, unit_hash, deterministic=True)
        return con

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``): all of it or nothing."""
        with self._lock, readable_errors(self.path):
            con = self.connection()
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: a consistent view across its statements, blocking no writer (WAL)."""
        with self._lock, readable_errors(self.path):
            con = self.connection()
            con.execute("BEGIN")
            try:
                yield con
            finally:
                if con.in_transaction:
                    con.execute("COMMIT")

    def version(self) -> int:
        """A number that changes once another connection (the daemon's, another loader's) has committed
        to the ledger since the last call (SQLite's ``PRAGMA data_version``); this one's own commits do
        not change it. It reads no table and takes no transaction: a probe for waiters to poll often."""
        with self._lock, readable_errors(self.path):
            return int(self.connection().execute("PRAGMA data_version").fetchone()[0])

    def intact(self) -> bool:
        """Whether SQLite finds the database whole (``PRAGMA quick_check``, reads every page)."""
        try:
            with self.read() as con:
                return bool(con.execute("PRAGMA quick_check").fetchone()[0] == "ok")
        except LedgerError:
            return False

    def get(self, key: str) -> Any:
        """The ``kv`` value ``key`` (decoded JSON), or None."""
        with self.read() as con:
            return kv(con, key)

    def set(self, key: str, value: Any) -> None:
        with self.write() as con:
            set_kv(con, key, value)

    def close(self) -> None:
        with self._lock:
            self._con.close()
            if self._key is not None:
                with _OPEN_HERE_LOCK:
                    _OPEN_HERE[self._key] -= 1
                self._key = None


# -- statements (inside a transaction) ------------------------------------------------------------


def kv(con: sqlite3.Connection, key: str) -> Any:
    row = con.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    return None if row is None else json.loads(row[0])


def set_kv(con: sqlite3.Connection, key: str, value: Any) -> None:
    con.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, json.dumps(value)))


def incr(con: sqlite3.Connection, name: str, delta: int) -> None:
    """Add ``delta`` to counter ``name`` (made at 0) inside the transaction of ``con``."""
    con.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                (name, delta))


class Counters:
    """The ``counters`` table of ``db`` (``Ledger.counters``): named totals that only grow, such as
    units fetched, retries, shards evicted; the ledger's own writes add to them in their transactions."""

    def __init__(self, db: LedgerDatabase) -> None:
        self._db = db

    def incr(self, name: str, delta: int = 1) -> None:
        """Add ``delta`` to counter ``name``, in a transaction of its own."""
        with self._db.write() as con:
            incr(con, name, delta)

    def all(self) -> dict[str, int]:
        """Every counter by name."""
        with self._db.read() as con:
            return dict(con.execute("SELECT name, value FROM counters"))


def unit_hash(key: str) -> int:
    """A unit key's 64-bit hash as SQLite's signed integer (the ``units`` and ``trained_units`` keys)."""
    value = xxhash.xxh3_64_intdigest(key.encode())
    return value - 2**64 if value >= 2**63 else value


def delete_shards(con: sqlite3.Connection, shard_ids: Sequence[str]) -> None:
    """Remove the records of ``shard_ids`` (those published) and their units from the index, in two
    statements whatever their number (``con`` is a :class:`LedgerDatabase`'s: ``unit_hash`` in SQL),
    so inserting a rebuild's 100,000 records costs no query per record to learn that none was there.
    (Deleting the units of an eviction batch of 90,000 shards, one unit each: 1.7 s by a statement per
    unit, 1.0-1.3 s so.)"""
    ids = json.dumps(list(shard_ids))
    con.execute("DELETE FROM units WHERE (h, shard) IN (SELECT unit_hash(unit.value), s.n FROM shards AS s, "
                "json_each(s.units) AS unit WHERE s.id IN (SELECT value FROM json_each(?)))", (ids,))
    con.execute("DELETE FROM shards WHERE id IN (SELECT value FROM json_each(?))", (ids,))
