"""The ledger's SQLite schema, its version, and opening a database with errors made readable.

Tables (every value typed or JSON, never pickle: a file a user can write must not run code in the
processes that open the cache):

- ``shards``: one row per published shard; ``state`` 0 = live, 1 = retiring. ``file`` is NULL when
  the file has its canonical name ``<id>.<checksum>.arrow``. ``uses``, ``last_used`` and ``recency``
  (``last_used`` or, never used, ``created``: the lru order) are the shard's counts as of use
  generation ``born``; each later generation (``generation``: one row, the latest snapshot's number
  and time) adds one use (see :mod:`epochcache.cache.ledger_uses`), so a snapshot writes no row per
  shard. Indexes give each eviction order and snapshots without a sort.
- ``units``: a 64-bit hash of each unit key -> the shard's row, so "is this unit cached" is a lookup.
- ``totals``: shards, bytes and rows per state, kept by triggers so budget checks are O(1).
- ``leases`` and ``lease_excluded``: a lease holds every shard with row number ``<= upto`` except
  those listed as excluded (retiring when it was taken); row numbers are never reused.
- ``quarantine``, ``skipped``, ``listing_pages``, ``counters``, ``kv`` (cursor, daemon state,
  identity, listings' headers, the reservation, as JSON; ``database``: a random name given when the
  database is created, so a process that kept records by row number knows a rebuilt one).
- ``trained_units``: the hash of every unit an epoch has trained on (``shards.trained`` marks the
  shards whose units are in, so an epoch adds only those of shards no epoch trained on before), and
  ``epochs``: one row per epoch run (its lease, samples, samples trained so far, distinct samples
  trained so far, bytes fetched so far, the shards' bytes, the daemon's estimate of the remote's
  rows), for coverage, echo and ``epochcache plot``.

Versions: 1 lacked ``shards.trained``, ``trained_units`` and ``epochs``; 2 lacked ``shards.born`` and
``generation`` and counted uses by rewriting every row at each snapshot (indexes ``shards_recency``
and ``shards_uses`` over the stored counts). The missing columns are added (``born`` = 0 at
generation 0: every stored count stays as it was), then every statement here is idempotent, so
running them brings a version-1 or -2 ledger to this one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import tenacity

from epochcache.errors import LedgerError, LedgerFullError

VERSION = 3
DB_NAME = "ledger.sqlite3"
LEGACY_DB_NAME = "cache.db"  # the diskcache ledger of epochcache before the schema

# How long opening the ledger keeps retrying while other processes hold its database locked, and how
# long a statement waits for another process's write transaction.
OPEN_PATIENCE_S = 60.0

Connect = Callable[[Path], sqlite3.Connection]

# The "dead-man switch" byte of a WAL database's -shm file (SQLite's os_unix.c: UNIX_SHM_DMS =
# (22 + SQLITE_SHM_NLOCK) * 4 + SQLITE_SHM_NLOCK): every process with a connection open holds a
# shared POSIX lock on it for as long as the connection lives.
_SHM_DMS_BYTE = 128

_DDL = """
CREATE TABLE IF NOT EXISTS shards(
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    file TEXT,
    bytes INTEGER NOT NULL,
    rows INTEGER NOT NULL,
    created REAL NOT NULL,
    checksum TEXT NOT NULL,
    units TEXT NOT NULL,
    uses INTEGER NOT NULL DEFAULT 0,
    last_used REAL,
    recency REAL NOT NULL,
    state INTEGER NOT NULL DEFAULT 0,
    schema TEXT NOT NULL DEFAULT '',
    verified INTEGER NOT NULL DEFAULT 0,
    trained INTEGER NOT NULL DEFAULT 0,
    born INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS shards_age ON shards(state, created, id);
DROP INDEX IF EXISTS shards_recency;
DROP INDEX IF EXISTS shards_uses;
CREATE INDEX IF NOT EXISTS shards_fresh ON shards(state, born, recency, created);
CREATE INDEX IF NOT EXISTS shards_wear ON shards(state, born - uses, created);
CREATE TABLE IF NOT EXISTS generation(id INTEGER PRIMARY KEY CHECK (id = 0), g INTEGER NOT NULL, at REAL NOT NULL);
INSERT OR IGNORE INTO generation VALUES (0, 0, 0.0);
CREATE TABLE IF NOT EXISTS units(h INTEGER NOT NULL, shard INTEGER NOT NULL, PRIMARY KEY(h, shard)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS totals(state INTEGER PRIMARY KEY, shards INTEGER NOT NULL, bytes INTEGER NOT NULL,
                    rows INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0, 0), (1, 0, 0, 0);
CREATE TRIGGER IF NOT EXISTS shards_in AFTER INSERT ON shards BEGIN
    UPDATE totals SET shards = shards + 1, bytes = bytes + new.bytes, rows = rows + new.rows
    WHERE state = new.state;
END;
CREATE TRIGGER IF NOT EXISTS shards_out AFTER DELETE ON shards BEGIN
    UPDATE totals SET shards = shards - 1, bytes = bytes - old.bytes, rows = rows - old.rows
    WHERE state = old.state;
END;
CREATE TRIGGER IF NOT EXISTS shards_moved AFTER UPDATE OF state, bytes, rows ON shards BEGIN
    UPDATE totals SET shards = shards - 1, bytes = bytes - old.bytes, rows = rows - old.rows
    WHERE state = old.state;
    UPDATE totals SET shards = shards + 1, bytes = bytes + new.bytes, rows = rows + new.rows
    WHERE state = new.state;
END;
CREATE TABLE IF NOT EXISTS leases(id TEXT PRIMARY KEY, owner TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
                    started INTEGER NOT NULL, expires REAL NOT NULL, taken REAL NOT NULL,
                    upto INTEGER NOT NULL, shards INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lease_excluded(lease TEXT NOT NULL, shard INTEGER NOT NULL, PRIMARY KEY(lease, shard))
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS quarantine(id TEXT PRIMARY KEY, record TEXT NOT NULL, bytes INTEGER NOT NULL,
                        reason TEXT NOT NULL, at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS skipped(unit TEXT PRIMARY KEY, info TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS listing_pages(stream TEXT NOT NULL, number INTEGER NOT NULL, objects TEXT NOT NULL,
                           PRIMARY KEY(stream, number)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kv(key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO kv VALUES ('database', '"' || lower(hex(randomblob(16))) || '"');
CREATE INDEX IF NOT EXISTS shards_untrained ON shards(n) WHERE trained = 0;
CREATE TABLE IF NOT EXISTS trained_units(h INTEGER PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS epochs(n INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, lease TEXT NOT NULL,
                    samples INTEGER NOT NULL, trained REAL NOT NULL, distinct_trained REAL NOT NULL,
                    fetched_bytes INTEGER NOT NULL, cache_bytes INTEGER NOT NULL, remote_rows INTEGER);
"""


def connect(path: Path) -> sqlite3.Connection:
    """The default connection factory: autocommit (transactions are explicit), WAL, busy waits."""
    con = sqlite3.connect(path, timeout=OPEN_PATIENCE_S, isolation_level=None, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    # A WAL grows until a checkpoint: keep it small (it is charged to the budget, see LEDGER_RESERVE).
    con.execute("PRAGMA wal_autocheckpoint=32")
    con.execute("PRAGMA journal_size_limit=131072")
    con.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable but for the last commits at power loss
    return con


def open_elsewhere(path: Path) -> bool:
    """Whether another process has the WAL database at ``path`` open: a lock this process cannot take
    on its -shm file's dead-man-switch byte (the lock SQLite holds for every open connection); True
    too where this user may not open that file to lock it (it cannot tell). Call it with no
    connection of this process open on ``path``: closing a descriptor drops every POSIX lock this
    process holds on that file, SQLite's included."""
    try:
        fd = os.open(path.with_name(path.name + "-shm"), os.O_RDWR)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _SHM_DMS_BYTE)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, _SHM_DMS_BYTE)
        return False
    finally:
        os.close(fd)


def open_database(path: Path, factory: Connect) -> sqlite3.Connection:
    """Connect to the ledger at ``path`` and create its schema if it is new.

    Retries while SQLite answers "database is locked" (switching to WAL, or creating the schema,
    while another process writes). Raises :class:`LedgerError` if the file is not a ledger of this
    version (garbage, truncated, or written by a newer epochcache).
    """
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_locked),
        wait=tenacity.wait_random_exponential(multiplier=0.01, max=0.5),
        stop=tenacity.stop_after_delay(OPEN_PATIENCE_S),
        reraise=True,
    )
    with readable_errors(path):
        con: sqlite3.Connection = retrying(_open, path, factory)
    return con


def _open(path: Path, factory: Connect) -> sqlite3.Connection:
    con = factory(path)
    try:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version < VERSION:
            # Every statement is idempotent, so processes creating (or upgrading) the schema together agree.
            if version >= 1:
                _add_columns(con)
            con.executescript(f"BEGIN IMMEDIATE;{_DDL}PRAGMA user_version={VERSION};COMMIT;")
        elif version != VERSION:
            raise LedgerError(
                f"the ledger {path} has schema version {version}, this epochcache reads version {VERSION}: "
                "upgrade epochcache, or run `epochcache verify --fix` to rebuild it from the shard files"
            )
    except BaseException:
        con.close()
        raise
    return con


# Columns later versions added to ``shards`` (the statements of the schema cannot add a column).
_ADDED_COLUMNS = {"trained": "INTEGER NOT NULL DEFAULT 0",  # version 2
                  "born": "INTEGER NOT NULL DEFAULT 0"}  # version 3: stored counts are as of generation 0


def _add_columns(con: sqlite3.Connection) -> None:
    """Add the columns of :data:`_ADDED_COLUMNS` an older ledger's ``shards`` lacks."""
    con.execute("BEGIN IMMEDIATE")
    try:
        columns = {row[1] for row in con.execute("PRAGMA table_info(shards)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in columns:  # another process may have added it before we got the lock
                con.execute(f"ALTER TABLE shards ADD COLUMN {name} {kind}")
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def is_locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


@contextmanager
def readable_errors(path: Path) -> Iterator[None]:
    """Turn SQLite's errors about the file into :class:`LedgerFullError` / :class:`LedgerError`
    (one line naming the file and the fix); "locked" passes through for the caller to retry."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        if is_locked(exc):
            raise
        if "full" in str(exc):
            raise LedgerFullError(
                f"the ledger {path} could not be written: {exc}; nothing was changed; free space on its "
                "filesystem (epochcache retries)"
            ) from exc
        raise LedgerError(
            f"the ledger {path} is unreadable ({exc}); run `epochcache verify --fix` to rebuild it from the "
            "shard files (each carries its own record)"
        ) from exc
