"""Shard assembly: the rows of units fetched in order, gathered until a shard's worth.

In: each unit's table. Out: :class:`Building` (tables, unit keys, bytes, the cursor just past the
last unit) for the writer. :func:`screen` keeps out rows no batch can hold: a null in a fixed-width
column, at any depth (it becomes a tensor, which has no null), drops the row, counted.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from epochcache.arrays import flags, unpacked
from epochcache.cache.columns import is_fixed_width
from epochcache.sources import Unit
from epochcache.sources.pool import ROWS_POOL
from epochcache.sync.combine import combine
from epochcache.sync.mixing import MixCursor


@dataclass
class Building:
    """Units fetched in order and not yet published, with the cursor just past the last of them."""

    cursor: MixCursor
    tables: list[pa.Table] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    nbytes: int = 0

    def reset(self, cursor: MixCursor) -> None:
        """Start the next shard from ``cursor`` (the previous one was handed to the writer)."""
        self.cursor, self.tables, self.units, self.nbytes = cursor, [], [], 0

    def add(self, unit: Unit, table: pa.Table) -> None:
        self.tables.append(table)
        self.units.append(unit.key)
        self.nbytes += table.nbytes

    def drop(self, keys: Collection[str]) -> list[str]:
        """Take out the units of ``keys`` with their rows; the keys taken out."""
        kept = [(key, table) for key, table in zip(self.units, self.tables) if key not in keys]
        dropped = [key for key in self.units if key in keys]
        self.units, self.tables = [key for key, _ in kept], [table for _, table in kept]
        self.nbytes = sum(table.nbytes for table in self.tables)
        return dropped

    def rows(self) -> pa.Table:
        """The shard's rows as one chunk per column (a shard file holds one record batch), copied
        once from the units' tables into :data:`ROWS_POOL` by :func:`combine`, which lets each unit
        go once its rows are copied: the units and the shard are never both held whole."""
        return combine(self.tables, ROWS_POOL)


def screen(table: pa.Table) -> tuple[pa.Table, int]:
    """``table`` without its rows that hold a null in a fixed-width column, at any depth (a null item
    of a fixed-size list row too: its slot has bytes all the same), and how many were dropped."""
    masks = []
    for column in table.columns:
        if not is_fixed_width(column.type):
            continue
        parts = [_whole_rows(chunk) for chunk in column.chunks]
        if any(part is not None for part in parts):
            masks.append(np.concatenate([np.ones(len(chunk), bool) if part is None else part
                                         for chunk, part in zip(column.chunks, parts)]))
    if not masks:
        return table, 0
    kept = table.filter(flags(np.logical_and.reduce(masks)))
    return kept, table.num_rows - kept.num_rows


def _whole_rows(array: pa.Array) -> np.ndarray | None:
    """Which rows of the fixed-width ``array`` hold no null at any depth; None when all of them."""
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    whole = unpacked(array.is_valid()) if array.null_count else None
    if pa.types.is_fixed_size_list(array.type) and len(array):
        size = array.type.list_size
        inner = _whole_rows(array.values.slice(array.offset * size, len(array) * size))
        if inner is not None:
            rows = np.all(inner.reshape(len(array), size), axis=1)
            whole = rows if whole is None else whole & rows
    return whole
