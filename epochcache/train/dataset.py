"""ShardSetDataset: a map-style torch Dataset over memory-mapped Arrow shards.

Per process, shards are memory-mapped on demand (through the loader's shared least-recently-used
set, :class:`epochcache.train.mappings.ShardMaps`, so consecutive epochs reuse mappings) and each
dataset holds at most ``max_open_shards`` of them, dropping the least recently read, so any number
of shards stays under the kernel's map limit (:mod:`epochcache.train.held`: which shards are held,
their column views, the row spaces). Every fixed-width column (numbers, fixed-size lists,
the fixed-shape tensor type) is viewed as one read-only numpy array of shape ``(rows, *item_shape)``
that points into the mapping: opening costs no copy and no per-sample object. A batch
(``__getitems__``) gathers each such column with one numpy call, whatever the number of shards it
touches (:mod:`epochcache.train.rowspace`), into a fresh array that torch wraps without a copy: one
copy in all, the gather itself. Rows come in the order asked (the sampler's shuffle), less the rows
of a shard that cannot be read. ``batches(sampler)`` gives an epoch's batches the same, but locates
the rows of up to 64 batches at once (one numpy call per column per batch is then left); ``jobs``
gives them as functions that build them, for building on more than one thread
(:mod:`epochcache.train.jobs`);
``gather_into`` writes the columns into given arrays instead (a worker's shared-memory slot).

What each column becomes follows from its Arrow type alone (:mod:`epochcache.cache.columns`), so it is the
same in every batch: string columns (and ``__key__`` when selected) a list of ``str`` per batch;
binary columns a list of ``pyarrow.Buffer``, each a zero-copy slice of the mapped file, for a user
decode function (see :mod:`epochcache.train.transform`); nested variable lists and structs a pyarrow array.
Nulls in a fixed-width column are a :class:`LoaderError`, not a silent change of kind.

Invariant: a batch holds only values read from a shard. Every shard must have the column types of
the first one read; a shard that differs is refused, so no batch array is left partly unfilled.

Shards are opened lazily in the process that reads them, so pickling the dataset into DataLoader
workers sends paths, never data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from epochcache.arrays import numbers
from epochcache.train.held import BufferColumn, Column, HeldShards, StringColumn, Views, distinct
from epochcache.train.jobs import FENCE, Job, Planned, run_in_order
from epochcache.train.mappings import DEFAULT_MAX_OPEN_SHARDS, ShardMaps
from epochcache.train.order import EpochBatches
from epochcache.train.rowspace import RowPlan

# Column name -> a tensor, a list of str or of pyarrow.Buffer, or a pyarrow array (by the column's
# type, see the module docstring): Any, so that callers index a batch without narrowing a union.
Batch = dict[str, Any]


class ShardSetDataset(Dataset[Batch]):
    """Rows of ``paths`` (with ``rows[i]`` rows each) in order; ``columns`` None = all but the key.

    Every shard must hold the selected columns with the types of the first readable shard (the
    dataset's schema); a shard that differs is a :class:`LoaderError`, never a batch built from
    memory that no shard filled. A shard that cannot be read (truncated, not Arrow, gone) is left out:
    its rows are dropped from the batches that chose them and ``on_unreadable(path, error)`` is told.
    """

    def __init__(
        self, paths: Sequence[str | Path], rows: Sequence[int], columns: Sequence[str] | None = None,
        maps: ShardMaps[Views] | None = None, on_unreadable: Callable[[str, Exception], None] | None = None,
        max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS, max_mapped_bytes: int | None = None,
    ):
        """``maps``: this process's open shard mappings (a loader shares one across its epochs, so
        consecutive epochs reuse them); None makes one of ``max_open_shards`` and ``max_mapped_bytes``
        (see :class:`ShardMaps`) on first use. Workers (after pickling) make their own, with the same
        bounds. ``on_unreadable`` must pickle if workers read the dataset."""
        if len(paths) != len(rows):
            raise ValueError(f"{len(paths)} shard paths but {len(rows)} row counts")
        self._offsets = np.concatenate([[0], np.cumsum(np.asarray(rows, dtype=np.int64))])
        self._shards = HeldShards([str(p) for p in paths], columns, maps,
                                  maps.capacity if maps is not None else max_open_shards, on_unreadable,
                                  maps.max_mapped_bytes if maps is not None else max_mapped_bytes)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def max_open_shards(self) -> int:
        return self._shards.max_open

    @property
    def max_mapped_bytes(self) -> int | None:
        return self._shards.max_mapped

    def use_maps(self, maps: ShardMaps[Views]) -> None:
        """Open shards through ``maps`` (a process's set, kept across epochs) from now on: an unpickled
        dataset (in a worker) otherwise maps every shard anew."""
        self._shards.use_maps(maps)

    def trimmed(self, batch: Batch) -> Batch:
        """``batch``, once the mapped shards' pages were let go if this process's mapped bytes grew past
        ``max_mapped_bytes`` (:meth:`ShardMaps.trim`): the last step of a batch thread's job, after
        the transforms and pinning. (Building a batch trims before it reads too.) Without it the pages
        a batch and its transform touched (the page folio around each row: 64 KiB on shards the
        daemon wrote, :data:`epochcache.cache.shards.WRITE_CHUNK`) stay mapped until the next batch
        is built."""
        self._shards.trim()
        return batch

    def open(self) -> None:
        """Map (hold) up to ``max_open_shards`` of the shards now, ahead of the first batch, which would
        otherwise pay for mapping every shard it touches."""
        if self._shards.count:
            self._shards.reference()
            self._shards.hold(np.arange(min(self._shards.count, self._shards.max_open)))

    def __getitem__(self, index: int) -> Batch:
        batch = self.__getitems__([index])
        return {name: value[0] for name, value in batch.items()}

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The rows at ``indices`` as one batch, in that order: tensors of shape ``(rows, *item_shape)``;
        ``rows`` is ``len(indices)`` less the rows of unreadable shards. (A batch touching more shards
        than ``max_open_shards`` is gathered in parts of that many shards, and comes out part by part.)"""
        shard_of, local = self._locate(indices)
        template = self._shards.reference()
        parts = [self._gather(shard_of[rows], local[rows]) for rows in self._parts(shard_of)]
        return {name: _join([part[name] for part in parts], column) for name, column in template.items()}

    def batches(self, sampler: EpochBatches) -> Iterator[Batch]:
        """``sampler``'s batches, each as ``__getitems__`` gives it: :meth:`jobs`, run in order."""
        return run_in_order(self.jobs(sampler))

    def jobs(self, sampler: EpochBatches) -> Iterator[Planned]:
        """``sampler``'s batches as jobs (:mod:`epochcache.train.jobs`), each building the batch
        ``__getitems__`` would give, planned run by run (:meth:`EpochBatches.runs`): a run whose
        shards can all be held at once (every run, when the epoch's shards fit in
        ``max_open_shards``) is located and given its rows' addresses in one vectorised pass, after
        which a job costs one numpy call per fixed-width column and may run on any thread; any
        other run (too many shards, or an unreadable one) is gathered here, batch by batch, as it is
        planned (holding shards is planning), its jobs handing over the built batches.

        Planning (iterating this) must stay on one thread, like the rest of the dataset. A run's
        shards stay held until the next run is planned, and only then may shards be dropped (when
        the epoch has more than ``max_open_shards``): a :data:`FENCE` then comes before every run
        but the first."""
        size = sampler.batch_size
        may_drop = self._shards.count > self._shards.max_open
        for number, run in enumerate(sampler.runs()):
            if number and may_drop:
                yield FENCE
            shard_of, local = self._locate(run)
            if self._hold_run(shard_of):
                yield from self._planned(shard_of, local, size)
            else:
                for start in range(0, len(run), size):
                    yield partial(_built, self.__getitems__(run[start : start + size]))

    def _locate(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each index's shard number and row within that shard."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"index out of range for a dataset of {len(self)} samples")
        shard_of = np.searchsorted(self._offsets, idx, side="right") - 1
        return shard_of, idx - self._offsets[shard_of]

    def _hold_run(self, shard_of: np.ndarray) -> bool:
        """Hold every shard of a run if they fit in ``max_open_shards`` together and all can be read."""
        self._shards.reference()
        if self._shards.count > self._shards.max_open and len(distinct(shard_of)) > self._shards.max_open:
            return False
        return bool(self._shards.hold(shard_of).all())

    def _planned(self, shard_of: np.ndarray, local: np.ndarray, size: int) -> Iterator[Job]:
        """A held run's jobs of ``size`` rows: its positions in every row space computed at once."""
        plans = {name: space.plan(shard_of, local) for name, space in self._shards.spaces.items()}
        others = [name for name in self._shards.reference() if name not in self._shards.spaces]
        for start in range(0, len(shard_of), size):
            yield partial(self._build, plans, others, shard_of[start : start + size], local[start : start + size],
                          start, start + size)

    def _build(self, plans: dict[str, RowPlan], others: list[str], shard_of: np.ndarray, local: np.ndarray,
               start: int, end: int) -> Batch:
        """Rows ``start:end`` of a planned run (``shard_of`` and ``local``: theirs), while its shards are held."""
        self._shards.trim()
        batch = {name: torch.from_numpy(plan.rows(start, end)) for name, plan in plans.items()}
        if others:
            batch.update(self._gather_by_shard(others, shard_of, local))
            batch = {name: batch[name] for name in self._shards.reference()}  # the columns' order, as always
        return batch

    def _parts(self, shard_of: np.ndarray) -> list[Any]:
        """Row selections of a batch, each touching at most ``max_open_shards`` shards (one, all rows, mostly)."""
        if self._shards.count <= self._shards.max_open:
            return [slice(None)]
        touched = distinct(shard_of)
        if len(touched) <= self._shards.max_open:
            return [slice(None)]
        groups = [touched[i : i + self._shards.max_open] for i in range(0, len(touched), self._shards.max_open)]
        return [np.flatnonzero(np.isin(shard_of, group)) for group in groups]

    def gather_into(self, indices: Sequence[int] | np.ndarray, into: Mapping[str, np.ndarray]) -> tuple[int, Batch]:
        """The rows at ``indices`` as ``__getitems__`` gives them, but each fixed-width column written into
        ``into`` (name -> a C-contiguous array with room for ``len(indices)`` rows: a worker's shared-memory
        slot) instead of a fresh tensor, by :meth:`RowSpace.rows_into`. Returns how many rows were
        written (the indices less the rows of unreadable shards) and the other columns."""
        shard_of, local = self._locate(indices)
        template = self._shards.reference()
        parts, rows = [], 0
        for part in self._parts(shard_of):
            parts.append(self._gather(shard_of[part], local[part], into, rows))
            rows += len(parts[-1][next(iter(self._shards.spaces))])
        return rows, {name: _join([p[name] for p in parts], column)
                      for name, column in template.items() if name not in self._shards.spaces}

    def _gather(self, shard_of: np.ndarray, local: np.ndarray, into: Mapping[str, np.ndarray] | None = None,
                at: int = 0) -> dict[str, Any]:
        """Rows ``local`` of shards ``shard_of`` (at most ``max_open_shards`` shards), those of unreadable
        shards left out: each fixed-width column in one call (epochcache.train.rowspace), into fresh
        arrays or, given ``into``, into its arrays from row ``at`` on; others per shard."""
        self._shards.trim()
        readable = self._shards.hold(shard_of)
        if not readable.all():
            shard_of, local = shard_of[readable], local[readable]
        batch: dict[str, Any] = {}
        for name, space in self._shards.spaces.items():
            positions = space.positions(shard_of, local)
            if into is None:
                batch[name] = space.rows_at(positions)
            else:
                batch[name] = into[name][at : at + len(positions)]
                space.rows_into(positions, batch[name])
        others = [name for name in self._shards.reference() if name not in batch]
        if others:
            batch.update(self._gather_by_shard(others, shard_of, local))
        return batch

    def _gather_by_shard(self, names: list[str], shard_of: np.ndarray, local: np.ndarray) -> dict[str, Any]:
        """Columns ``names`` (strings, binary, nested: Python or Arrow values per row) of the given rows, in
        their order: one ``take`` per shard touched and column, then put back in the rows' order."""
        order = np.argsort(shard_of, kind="stable")
        grouped, rows = shard_of[order], local[order]
        splits = (np.flatnonzero(np.diff(grouped)) + 1).tolist()
        values: dict[str, list[Any]] = {name: [] for name in names}
        runs = zip([0, *splits], [*splits, len(grouped)]) if len(grouped) else ()  # (no row: all unreadable)
        for start, end in runs:
            views = self._shards.held(int(grouped[start]))
            for name in names:
                col = views[name]
                if isinstance(col, (BufferColumn, StringColumn)):
                    values[name].extend(col.take(rows[start:end]))
                else:
                    values[name].append(col.take(numbers(rows[start:end])))
        back = np.argsort(order)  # where each row of the batch is in the grouped order
        return {name: _reorder(values[name], back, self._shards.reference()[name]) for name in names}

    def fixed_layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The fixed-width (tensor) columns, as name -> (dtype, item shape), of the dataset's schema
        (every shard's, see the class docstring); empty for an empty dataset."""
        return self._shards.fixed_layout()


def _built(batch: Batch) -> Batch:
    """A job whose batch was built as it was planned."""
    return batch


def _reorder(values: list[Any], back: np.ndarray, column: Column) -> Any:
    """A non-tensor column's values, gathered shard by shard, put back in the batch's row order
    (``back[i]``: where row i is among them): a list, or one Arrow array."""
    if isinstance(column, (BufferColumn, StringColumn)):
        return [values[i] for i in back.tolist()]
    if not values:
        return column.slice(0, 0) if isinstance(column, pa.Array) else []
    joined = pa.concat_arrays(values) if len(values) != 1 else values[0]
    return joined.take(numbers(back))


def _join(parts: list[Any], column: Column) -> Any:
    """One column's batch value from the values of its parts (one part, mostly): a tensor, a list, or
    one Arrow array."""
    if isinstance(column, np.ndarray):
        return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))
    if len(parts) == 1:
        return parts[0]
    if isinstance(column, (BufferColumn, StringColumn)):
        return [value for part in parts for value in part]
    return pa.concat_arrays(parts)
