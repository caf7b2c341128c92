"""Shard assembly: the rows of units fetched in order, gathered until a shard's worth.

In: each unit's table. Out: :class:`Building` (tables, unit keys, bytes, the cursor just past the
last unit) for the writer. :func:`screen` keeps out rows no batch can hold: a null in a fixed-width
column (it becomes a tensor, which has no null) drops the row, counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

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

    def rows(self) -> pa.Table:
        """The shard's rows as one chunk per column (a shard file holds one record batch), copied
        once from the units' tables into :data:`ROWS_POOL` by :func:`combine`, which lets each unit
        go once its rows are copied: the units and the shard are never both held whole."""
        return combine(self.tables, ROWS_POOL)


def screen(table: pa.Table) -> tuple[pa.Table, int]:
    """``table`` without its rows that hold a null in a fixed-width column, and how many were dropped."""
    fixed = [name for name, column in zip(table.column_names, table.columns)
             if is_fixed_width(column.type) and column.null_count]
    if not fixed:
        return table, 0
    keep = pc.is_valid(table.column(fixed[0]))
    for name in fixed[1:]:
        keep = pc.and_(keep, pc.is_valid(table.column(name)))
    kept = table.filter(keep)
    return kept, table.num_rows - kept.num_rows
