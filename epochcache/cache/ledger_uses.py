"""Use counts by generation: how the ledger knows each shard's uses without a write per shard.

Every snapshot is one *use generation*: the ``generation`` row holds the latest one's number ``g``
and time ``t``. A snapshot takes every live shard, so a live shard's row stores its counts as of the
generation it was born into (``born``: published, adopted, or returned from retiring) and every
later generation adds one use:

    uses      = uses + g - born
    last_used = t if born < g else last_used        (and ``recency`` likewise)

Retiring shards are the exceptions a snapshot leaves out: when a shard retires its counts are
folded into its row (``born`` = g), and each snapshot moves a retiring shard's ``born`` on with
``g`` (O(retiring shards), not O(cache)), so the same formula holds for every row.

Eviction orders stay index walks (O(k log n) for k victims): ``uses`` descending is ``born - uses``
ascending (the ``shards_wear`` index, which also serves bounds on uses); ``recency`` merges two
walks: shards born into the latest generation, by their stored recency (``shards_fresh``), and the
others, all last used at ``t``, by age (``shards_age``); ``random`` draws row numbers.

In: a connection inside a transaction. Out: :class:`ShardRecord` values with the derived counts.
"""

from __future__ import annotations

import heapq
import json
import random
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

from epochcache.cache.layout import SHARD_SUFFIX
from epochcache.cache.ledger_records import ShardRecord, Stage

USES = "uses + :g - born"
LAST_USED = "CASE WHEN born < :g THEN :t ELSE last_used END"
RECENCY = "CASE WHEN born < :g THEN :t ELSE recency END"

# A shard's file name: ``file`` is NULL where it is the canonical ``<id>.<checksum>.arrow``.
FILENAME = f"coalesce(file, id || '.' || checksum || '{SHARD_SUFFIX}')"
# A record's columns in ShardRecord's order, counts derived, ``units`` as JSON.
COLUMNS = f"n, id, {FILENAME}, bytes, rows, created, checksum, units, {USES}, {LAST_USED}, schema, verified"
_WIDTH = 12  # the fields of a record row; a walk's rows add their sort key after them

# Counts folded into the row as of generation :g (a shard leaving the live set: retiring).
FOLD = f"uses = {USES}, last_used = {LAST_USED}, recency = {RECENCY}, born = :g"


def clock(con: sqlite3.Connection) -> dict[str, Any]:
    """The latest generation as the named parameters ``g`` and ``t`` of the expressions above."""
    g, t = con.execute("SELECT g, at FROM generation").fetchone()
    return {"g": g, "t": t}


def advance(con: sqlite3.Connection, now: float) -> None:
    """Begin a generation at ``now`` (a snapshot of every live shard): one row, plus the retiring
    shards, which it leaves out, moved along so their counts stay as they are."""
    con.execute("UPDATE generation SET g = g + 1, at = ?", (now,))
    con.execute("UPDATE shards SET born = born + 1 WHERE state = 1")


def retire(con: sqlite3.Connection, shard_ids: Sequence[str]) -> None:
    """Make the live shards among ``shard_ids`` retiring, their counts folded in as of the latest
    generation (snapshots leave retiring shards out). One statement: 100,000 shards in 0.33 s, where
    a statement a shard took 1.77 s (an eviction batch stalled publishing that long)."""
    # (+state: looked up by id; on ``state = 0`` SQLite walked the whole live set by shards_age)
    con.execute(f"UPDATE shards SET {FOLD}, state = 1 WHERE id IN (SELECT value FROM json_each(:ids)) AND +state = 0",
                {**clock(con), "ids": json.dumps(list(shard_ids))})


_new = object.__new__


def record(row: Sequence[Any], with_units: bool = True) -> ShardRecord:
    """A :class:`ShardRecord` from a row of :data:`COLUMNS`; without ``with_units``, its ``units`` left
    empty: an eviction needs none of them (its victims are deleted by id and file), and decoding them
    took 0.2 s of a batch of 100,000 victims."""
    _, sid, filename, nbytes, rows, created, checksum, units, uses, last_used, schema, verified = row
    # Filled in place rather than through the frozen dataclass's __init__ (one object.__setattr__ per
    # field): listings and eviction walks decode many records.
    out: ShardRecord = _new(ShardRecord)
    out.__dict__.update(id=sid, filename=filename, nbytes=nbytes, rows=rows, created=created, checksum=checksum,
                        units=tuple(json.loads(units)) if with_units else (), uses=uses, last_used=last_used,
                        schema=schema, verified=bool(verified))
    return out


def _bounds(stage: Stage) -> str:
    """``stage``'s bounds on uses, written on ``born - uses`` (= g - uses) so ``shards_wear`` can serve them."""
    where = " AND born - uses <= :g - :at_least" if stage.at_least > 0 else ""
    return where + (" AND born - uses > :g - :below" if stage.below is not None else "")


def walks(stage: Stage) -> list[str]:
    """The statements that walk an ordered ``stage`` (one, or two to merge for ``recency``); each row
    is :data:`COLUMNS` then its sort key. Parameters: :func:`clock`'s, ``at_least`` and ``below``."""
    bounds = _bounds(stage)
    if stage.order == "age":
        return [f"SELECT {COLUMNS}, created, id FROM shards INDEXED BY shards_age WHERE state = 0{bounds} "
                "ORDER BY created, id"]
    if stage.order == "uses":
        return [f"SELECT {COLUMNS}, born - uses, created, id FROM shards INDEXED BY shards_wear "
                f"WHERE state = 0{bounds} ORDER BY born - uses, created, id"]
    return [  # recency: born into the latest generation (stored recency), then the rest (last used at t)
        f"SELECT {COLUMNS}, recency, created, id FROM shards INDEXED BY shards_fresh "
        f"WHERE state = 0 AND born = :g{bounds} ORDER BY recency, created, id",
        f"SELECT {COLUMNS}, :t, created, id FROM shards INDEXED BY shards_age "
        f"WHERE state = 0 AND born < :g{bounds} ORDER BY created, id",
    ]


def _walk(con: sqlite3.Connection, stage: Stage, params: dict[str, Any]) -> Iterator[Sequence[Any]]:
    """Rows of :data:`COLUMNS` (then their sort key) of ``stage``'s candidates, in its order."""
    args = {**params, "at_least": stage.at_least, "below": stage.below}
    if stage.order == "random":
        return _random(con, stage, args)
    return heapq.merge(*(con.execute(sql, args) for sql in walks(stage)), key=_sort_key)


def _sort_key(row: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(row[_WIDTH:])


# Misses a random walk may draw per candidate found before it loads the rest and shuffles them: the
# candidates are then fewer than one row number in 17 (or mostly drawn already).
_MISSES = 16


# The row numbers a random walk draws from (two subqueries: ``min(n), max(n)`` in one would scan).
SPAN = "SELECT (SELECT min(n) FROM shards), (SELECT max(n) FROM shards)"


def draw(stage: Stage) -> str:
    """The statement that looks a drawn row number ``:n`` up: a record if it is a candidate of ``stage``."""
    return f"SELECT {COLUMNS} FROM shards WHERE n = :n AND state = 0{_bounds(stage)}"


def _random(con: sqlite3.Connection, stage: Stage, args: dict[str, Any]) -> Iterator[Sequence[Any]]:
    """Candidates of ``stage`` in uniformly random order: row numbers drawn at random (each a rowid
    lookup, O(log n)), a draw that is no candidate drawn again; when too many draws miss, the
    candidates not yet drawn, shuffled (one scan)."""
    rng = random.Random(stage.seed)
    lo, hi = con.execute(SPAN).fetchone()
    if lo is None:
        return
    probe = draw(stage)
    drawn: set[int] = set()
    misses = 0
    while misses < _MISSES * (len(drawn) + 1):
        n = rng.randint(lo, hi)
        row = None if n in drawn else con.execute(probe, {**args, "n": n}).fetchone()
        if row is None:
            misses += 1
            continue
        drawn.add(n)
        yield row
    rest = [row for row in con.execute(f"SELECT {COLUMNS} FROM shards WHERE state = 0{_bounds(stage)} ORDER BY n",
                                       args) if row[0] not in drawn]
    rng.shuffle(rest)
    yield from rest


def choose_by_index(con: sqlite3.Connection, stages: Sequence[Stage], short: int) -> list[str]:
    """The ids of live shards in the order of ``stages`` (each walked by its index; a shard picked by
    one stage is not picked again) until their bytes reach ``short``: O(k log n) for k victims. No
    record is decoded: a batch of 100,000 picks held 100,000 records (~110 MB) for their ids."""
    params = clock(con)
    picked: list[str] = []
    seen: set[str] = set()
    freed = 0
    for stage in stages:
        for row in _walk(con, stage, params):
            if freed >= short:
                return picked
            sid, nbytes = row[1], row[3]  # (COLUMNS: n, id, file, bytes, ...)
            if sid not in seen:
                seen.add(sid)
                picked.append(sid)
                freed += nbytes
    return picked
