"""One configured source as the daemon walks it: its own passes, listing, cursor and row estimates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from epochcache.config import SourceConfig
from epochcache.errors import CorruptObjectError, OversizeUnitError
from epochcache.sources import Source, Unit
from epochcache.sync.slicing import Slicer


@dataclass
class Stream:
    """One configured source as the daemon walks it.

    ``totals``: objects of this node's share of each pass listed so far (for progress);
    ``rows_read`` and ``bytes_read``: of the units read whose metadata did not tell their rows (Arrow
    IPC, WebDataset), for :attr:`rows_per_byte`; ``estimates``: its estimates for units not read yet;
    ``unaccounted``: rows read minus rows estimated, for the pick to count next; ``idle_until``:
    while every unit of its last pass was cached, it gives no unit until then (monotonic seconds).
    ``node_bytes``, ``objects_counted``, ``rows_counted``: for :meth:`remote_rows`.
    """

    config: SourceConfig
    source: Source
    slicer: Slicer = field(default_factory=Slicer)  # this pass's row slices
    mix: int = 8  # this pass's objects per mixing window
    totals: dict[int, int] = field(default_factory=dict)
    rows_read: int = 0
    bytes_read: int = 0
    estimates: dict[str, int] = field(default_factory=dict)
    unaccounted: int = 0
    idle_until: float = 0.0
    idle_passes: int = 0  # passes in a row that found every unit cached (see walk.idle_wait)
    node_bytes: int | None = None  # this node's share of the current pass's listed bytes
    objects_counted: int = 0  # objects whose metadata told their rows, and those rows
    rows_counted: int = 0
    largest_unit: int | None = None  # the most bytes a unit may hold: one shard within the budget

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def rows_per_byte(self) -> float | None:
        """Rows per byte over every unit read whose metadata did not tell its rows (units differ: a
        WebDataset tar's from the next); None before the first."""
        return self.rows_read / self.bytes_read if self.bytes_read else None

    def read(self, unit: Unit) -> pa.Table:
        """All the unit's rows, as read (its slice is cut by :class:`~epochcache.sync.intake.Intake`);
        raises :class:`CorruptObjectError` for a unit of 0 rows whose metadata did not say so (skipped;
        one it says is empty, a Parquet row group of 0 rows, is read as such: nothing to cache),
        :class:`OversizeUnitError` for one over ``largest_unit`` bytes: by its metadata's size before
        it is fetched when every column is read (with ``columns``, the size a source knows beforehand may
        count what is not kept: a WebDataset tar's fields), else by its rows once read."""
        if self.largest_unit is not None and self.config.columns is None and unit.nbytes > self.largest_unit:
            raise self._oversize(unit, unit.nbytes, "by its metadata")
        table = self.source.read(unit)
        if table.num_rows == 0 and unit.rows != 0:
            raise CorruptObjectError(f"{unit.key} holds 0 rows")
        if self.largest_unit is not None and table.nbytes > self.largest_unit:
            raise self._oversize(unit, table.nbytes, "read")
        return table

    def _oversize(self, unit: Unit, nbytes: int, how: str) -> OversizeUnitError:
        return OversizeUnitError(
            f"{unit.key} holds {nbytes} bytes ({how}), more than one shard may within cache.max_bytes "
            f"({self.largest_unit} bytes with the ledger's share): skipped; raise cache.max_bytes, or write the "
            "remote in smaller units (Parquet row groups, Arrow record batches)"
        )


    def rows_of(self, unit: Unit) -> int:
        """The unit's rows from metadata, else estimated from its bytes (1 before any read) and
        remembered, so the read can correct the count."""
        if unit.rows is not None:
            return unit.rows
        share = self.rows_per_byte / (self.slicer.parts if unit.part is not None else 1) if self.rows_per_byte else 0
        estimate = max(1, round(unit.nbytes * share)) if share else 1
        self.estimates[unit.key] = estimate
        return estimate

    def count_rows(self, units: Sequence[Unit]) -> None:
        """Take in an object's units: where the metadata tells every unit's rows, count the object."""
        if units and all(unit.rows is not None for unit in units):
            self.objects_counted += 1
            self.rows_counted += sum(unit.rows or 0 for unit in units)

    def remote_rows(self, pass_: int) -> int | None:
        """An estimate of the rows of this node's share of ``pass_``: rows per object from the
        metadata read so far times the objects (Parquet, objects: exact once every footer was read),
        else rows per byte read times the listed bytes (Arrow IPC, WebDataset); None before either."""
        # A pass not listed yet (the cursor just moved past the last) has as many objects as the last.
        objects = self.totals.get(pass_, self.totals[max(self.totals)] if self.totals else None)
        if objects is not None and self.objects_counted:
            return round(self.rows_counted / self.objects_counted * objects)
        if self.rows_per_byte and self.node_bytes:
            return round(self.rows_per_byte * self.node_bytes)
        return None

    def learn(self, unit: Unit, whole: pa.Table, kept: int) -> None:
        """Take in a read unit (``whole``: all its rows; ``kept``: those of its slice): the estimate's
        error goes to ``unaccounted``."""
        if unit.rows is None:
            self.unaccounted += kept - self.estimates.pop(unit.key, kept)
            if unit.nbytes > 0:
                self.rows_read += whole.num_rows
                self.bytes_read += unit.nbytes
