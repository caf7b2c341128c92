"""ShardSetDataset: a map-style torch Dataset over memory-mapped Arrow shards.

Per process, shards are memory-mapped on demand (through the loader's shared least-recently-used
set, :class:`epochcache.train.mappings.ShardMaps`, so consecutive epochs reuse mappings) and each
dataset holds at most ``max_open_shards`` of them, dropping the least recently read, so any number
of shards stays under the kernel's map limit. Every fixed-width column (numbers, fixed-size lists,
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

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Union

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from epochcache.cache.columns import is_binary, is_fixed_width, is_string
from epochcache.errors import LoaderError, ShardCorruptError
from epochcache.sources.base import KEY_COLUMN
from epochcache.train.jobs import FENCE, Job, Planned, run_in_order
from epochcache.train.mappings import DEFAULT_MAX_OPEN_SHARDS, ShardMaps
from epochcache.train.order import EpochBatches
from epochcache.train.rowspace import RowPlan, RowSpace
from epochcache.train.shardplan import ShardPlan, open_planned

log = logging.getLogger(__name__)

# Column name -> a tensor, a list of str or of pyarrow.Buffer, or a pyarrow array (by the column's
# type, see the module docstring): Any, so that callers index a batch without narrowing a union.
Batch = dict[str, Any]
Column = Union[np.ndarray, pa.Array, "BufferColumn", "StringColumn"]
Views = dict[str, Column]

# A shard's state in a dataset, per process: not mapped by it, held (mapped, in the row spaces), unreadable.
_CLOSED, _HELD, _UNREADABLE = 0, 1, 2


class ShardSetDataset(Dataset[Batch]):
    """Rows of ``paths`` (with ``rows[i]`` rows each) in order; ``columns`` None = all but the key.

    Every shard must hold the selected columns with the types of the first readable shard (the
    dataset's schema); a shard that differs is a :class:`LoaderError`, never a batch built from
    memory that no shard filled. A shard that cannot be read (truncated, not Arrow, gone) is left out:
    its rows are dropped from the batches that chose them and ``on_unreadable(path, error)`` is told.
    """

    def __init__(
        self, paths: Sequence[Path], rows: Sequence[int], columns: Sequence[str] | None = None,
        maps: ShardMaps[Views] | None = None, on_unreadable: Callable[[str, Exception], None] | None = None,
        max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
    ):
        """``maps``: this process's open shard mappings (a loader shares one across its epochs, so
        consecutive epochs reuse them); None makes one of ``max_open_shards`` on first use. Workers
        (after pickling) make their own. ``on_unreadable`` must pickle if workers read the dataset."""
        if len(paths) != len(rows):
            raise ValueError(f"{len(paths)} shard paths but {len(rows)} row counts")
        self._paths = [str(p) for p in paths]
        self._offsets = np.concatenate([[0], np.cumsum(np.asarray(rows, dtype=np.int64))])
        self._columns = list(columns) if columns is not None else None
        self._maps = maps
        self._max_open = maps.capacity if maps is not None else max_open_shards
        self._on_unreadable = on_unreadable
        self._schema: dict[str, pa.DataType] | None = None  # name -> type, from the first readable shard
        self._schema_path = ""
        self._template: Views | None = None
        self._key = None if self._columns is None else tuple(self._columns)
        # A dataset of more shards than max_open_shards maps shards again as they are dropped: it keeps
        # where each shard's columns lie (epochcache.train.shardplan), so mapping one again skips the IPC parsing.
        self._plans: dict[str, ShardPlan] | None = None if len(self._paths) <= self._max_open else {}
        self._reset_held()

    def _reset_held(self) -> None:
        """No shard held: the per-process state (mappings and their addresses) starts empty."""
        # The shards whose views this dataset holds, at most max_open_shards: their fixed-width columns
        # are in the row spaces (one per column, epochcache.train.rowspace), which gather a batch.
        self._held: dict[int, Views] = {}
        self._spaces: dict[str, RowSpace] = {}  # made with the template (_reference)
        self._state = np.full(len(self._paths), _CLOSED, np.int8)
        self._last_used = np.zeros(len(self._paths), np.int64)  # the batch count when a shard was last read
        self._batches = 0

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def max_open_shards(self) -> int:
        return self._max_open

    def __getstate__(self) -> dict[str, Any]:
        held = ("_held", "_spaces", "_state", "_last_used", "_batches")
        plans: dict[str, ShardPlan] | None = None if self._plans is None else {}
        state = {k: v for k, v in self.__dict__.items() if k not in held}
        return {**state, "_maps": None, "_template": None, "_plans": plans}  # the spaces go with the template

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_held()

    def use_maps(self, maps: ShardMaps[Views]) -> None:
        """Open shards through ``maps`` (a process's set, kept across epochs) from now on: an unpickled
        dataset (in a worker) otherwise maps every shard anew."""
        self._maps = maps

    def open(self) -> None:
        """Map (hold) up to ``max_open_shards`` of the shards now, ahead of the first batch, which would
        otherwise pay for mapping every shard it touches."""
        if self._paths:
            self._reference()
            self._hold(np.arange(min(len(self._paths), self._max_open)))

    def __getitem__(self, index: int) -> Batch:
        batch = self.__getitems__([index])
        return {name: value[0] for name, value in batch.items()}

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The rows at ``indices`` as one batch, in that order: tensors of shape ``(rows, *item_shape)``;
        ``rows`` is ``len(indices)`` less the rows of unreadable shards. (A batch touching more shards
        than ``max_open_shards`` is gathered in parts of that many shards, and comes out part by part.)"""
        shard_of, local = self._locate(indices)
        template = self._reference()
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
        may_drop = len(self._paths) > self._max_open
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
        self._reference()
        if len(self._paths) > self._max_open and len(np.unique(shard_of)) > self._max_open:
            return False
        return bool(self._hold(shard_of).all())

    def _planned(self, shard_of: np.ndarray, local: np.ndarray, size: int) -> Iterator[Job]:
        """A held run's jobs of ``size`` rows: its positions in every row space computed at once."""
        plans = {name: space.plan(shard_of, local) for name, space in self._spaces.items()}
        others = [name for name in self._reference() if name not in self._spaces]
        for start in range(0, len(shard_of), size):
            yield partial(self._build, plans, others, shard_of[start : start + size], local[start : start + size],
                          start, start + size)

    def _build(self, plans: dict[str, RowPlan], others: list[str], shard_of: np.ndarray, local: np.ndarray,
               start: int, end: int) -> Batch:
        """Rows ``start:end`` of a planned run (``shard_of`` and ``local``: theirs), while its shards are held."""
        batch = {name: torch.from_numpy(plan.rows(start, end)) for name, plan in plans.items()}
        if others:
            batch.update(self._gather_by_shard(others, shard_of, local))
            batch = {name: batch[name] for name in self._reference()}  # the columns' order, as always
        return batch

    def _parts(self, shard_of: np.ndarray) -> list[Any]:
        """Row selections of a batch, each touching at most ``max_open_shards`` shards (one, all rows, mostly)."""
        if len(self._paths) <= self._max_open:
            return [slice(None)]
        touched = np.unique(shard_of)
        if len(touched) <= self._max_open:
            return [slice(None)]
        groups = [touched[i : i + self._max_open] for i in range(0, len(touched), self._max_open)]
        return [np.flatnonzero(np.isin(shard_of, group)) for group in groups]

    def gather_into(self, indices: Sequence[int] | np.ndarray, into: Mapping[str, np.ndarray]) -> tuple[int, Batch]:
        """The rows at ``indices`` as ``__getitems__`` gives them, but each fixed-width column written into
        ``into`` (name -> a C-contiguous array with room for ``len(indices)`` rows: a worker's shared-memory
        slot) instead of a fresh tensor, by :meth:`RowSpace.rows_into`. Returns how many rows were
        written (the indices less the rows of unreadable shards) and the other columns."""
        shard_of, local = self._locate(indices)
        template = self._reference()
        parts, rows = [], 0
        for part in self._parts(shard_of):
            parts.append(self._gather(shard_of[part], local[part], into, rows))
            rows += len(parts[-1][next(iter(self._spaces))])
        return rows, {name: _join([p[name] for p in parts], column)
                      for name, column in template.items() if name not in self._spaces}

    def _gather(self, shard_of: np.ndarray, local: np.ndarray, into: Mapping[str, np.ndarray] | None = None,
                at: int = 0) -> dict[str, Any]:
        """Rows ``local`` of shards ``shard_of`` (at most ``max_open_shards`` shards), those of unreadable
        shards left out: each fixed-width column in one call (epochcache.train.rowspace), into fresh
        arrays or, given ``into``, into its arrays from row ``at`` on; others per shard."""
        readable = self._hold(shard_of)
        if not readable.all():
            shard_of, local = shard_of[readable], local[readable]
        batch: dict[str, Any] = {}
        for name, space in self._spaces.items():
            positions = space.positions(shard_of, local)
            if into is None:
                batch[name] = space.rows_at(positions)
            else:
                batch[name] = into[name][at : at + len(positions)]
                space.rows_into(positions, batch[name])
        others = [name for name in self._reference() if name not in batch]
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
            views = self._held[int(grouped[start])]
            for name in names:
                col = views[name]
                if isinstance(col, (BufferColumn, StringColumn)):
                    values[name].extend(col.take(rows[start:end]))
                else:
                    values[name].append(col.take(pa.array(rows[start:end])))
        back = np.argsort(order)  # where each row of the batch is in the grouped order
        return {name: _reorder(values[name], back, self._reference()[name]) for name in names}

    def _hold(self, shard_of: np.ndarray) -> np.ndarray:
        """Whether each row's shard can be read; every readable one is held (mapped and in the row
        spaces) when this returns, shards least recently read dropped to stay within ``max_open_shards``."""
        self._batches += 1
        self._last_used[shard_of] = self._batches
        closed = self._state[shard_of] == _CLOSED
        if closed.any():  # (most batches: none; np.unique costs even on nothing)
            missing = np.unique(shard_of[closed])
            self._make_room(missing.size)
            for number in missing.tolist():
                self._open_into(number)
        return self._state[shard_of] == _HELD

    def _make_room(self, wanted: int) -> None:
        """Drop the least recently read held shards (never one of this batch) so ``wanted`` more fit."""
        excess = len(self._held) + wanted - self._max_open
        if excess <= 0:
            return
        held = np.fromiter(self._held, np.int64, len(self._held))
        ages = self._last_used[held]
        victims = held[np.argsort(ages, kind="stable")[:excess]]
        for number in victims[self._last_used[victims] < self._batches].tolist():
            for space in self._spaces.values():
                space.drop(number)  # before the views go: see RowSpace's invariant
            del self._held[number]
            self._state[number] = _CLOSED

    def _open_into(self, number: int) -> None:
        """Map shard ``number`` (or mark it unreadable) and put its fixed-width columns in the row spaces."""
        views = self._views(number)
        if views is None:
            return
        for name, space in self._spaces.items():
            space.add(number, views[name])  # type: ignore[arg-type]  # fixed-width: numpy, per the schema check
        self._held[number] = views
        self._state[number] = _HELD

    def fixed_layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The fixed-width (tensor) columns, as name -> (dtype, item shape), of the dataset's schema
        (every shard's, see the class docstring); empty for an empty dataset."""
        if not self._paths:
            return {}
        template = self._reference()
        return {name: (col.dtype, col.shape[1:]) for name, col in template.items() if isinstance(col, np.ndarray)}

    def _reference(self) -> Views:
        """The views of the first readable shard, whose column types every other shard must share; the
        row spaces of its fixed-width columns are made with it."""
        if self._template is None:
            for number in range(len(self._paths)):
                views = self._views(number)
                if views is not None:
                    self._spaces = {name: RowSpace(len(self._paths), col.dtype, col.shape[1:])
                                    for name, col in views.items() if isinstance(col, np.ndarray)}
                    self._template = views
                    break
            else:
                raise LoaderError(
                    f"none of the {len(self._paths)} shards of this epoch can be read (see the log for why; "
                    "they are quarantined): run `epochcache sync` to refill the cache"
                )
        return self._template

    def _views(self, number: int) -> Views | None:
        """Shard ``number``'s column views, mapped if not open; None if it cannot be read."""
        if number in self._held:
            return self._held[number]
        if self._state[number] == _UNREADABLE:
            return None
        if self._maps is None:
            self._maps = ShardMaps(self._max_open)
        path = self._paths[number]
        try:
            views = self._maps.get((path, self._key), lambda: self._open_one(path))
        except (ShardCorruptError, FileNotFoundError) as exc:
            self._state[number] = _UNREADABLE
            log.warning("shard %s cannot be read, its rows are left out of this epoch: %s", path, exc)
            if self._on_unreadable is not None:
                self._on_unreadable(path, exc)
            return None
        return views

    def _open_one(self, path: str) -> Views:
        known = self._plans.get(path) if self._plans is not None else None
        if known is not None:  # mapped before and checked then: one mmap, no IPC parsing
            return self._view(known.remap(path), path)
        arrays, schema, plan = open_planned(path)
        views = self._view(arrays, path)
        self._check_schema(schema, path)
        if self._plans is not None and plan is not None:
            self._plans[path] = plan
        return views

    def _check_schema(self, schema: pa.Schema, path: str) -> None:
        names = self._columns or [n for n in schema.names if n != KEY_COLUMN]
        types = {name: schema.field(name).type for name in names}
        if self._schema is None:
            self._schema, self._schema_path = types, path
        elif types != self._schema:
            raise LoaderError(
                f"shard {path} has columns {_describe(types)} but shard {self._schema_path} has "
                f"{_describe(self._schema)}: the cache holds rows of two schemas (written under different "
                "source columns or sources); empty it with `epochcache clear`, or give cache.dir a new directory"
            )

    def _view(self, arrays: dict[str, pa.Array], path: str) -> Views:
        names = self._columns or [n for n in arrays if n != KEY_COLUMN]
        missing = [n for n in names if n not in arrays]
        if missing:
            raise LoaderError(f"loader.columns names {missing}, absent from shard {path}: it has {list(arrays)}")
        views: Views = {}
        for name in names:
            array = arrays[name]
            if is_string(array.type):
                views[name] = StringColumn(array)
            elif is_binary(array.type):
                views[name] = BufferColumn(array)
            elif not is_fixed_width(array.type):
                views[name] = array
            elif array.null_count:
                raise LoaderError(
                    f"column {name!r} of shard {path} holds {array.null_count} nulls, but fixed-width columns "
                    "become tensors, which cannot: fill them in the remote, or leave the column out of loader.columns"
                )
            else:
                views[name] = _numpy_view(array)
        return views


def _built(batch: Batch) -> Batch:
    """A job whose batch was built as it was planned."""
    return batch


def _describe(types: dict[str, pa.DataType]) -> str:
    return "[" + ", ".join(f"{name}: {kind}" for name, kind in types.items()) + "]"


def _numpy_view(array: pa.Array) -> np.ndarray:
    """A zero-copy ``(rows, *item_shape)`` numpy view of a fixed-width column without nulls."""
    if isinstance(array.type, pa.FixedShapeTensorType):
        return np.ascontiguousarray(array.to_numpy_ndarray())
    shape = [len(array)]
    while pa.types.is_fixed_size_list(array.type):
        shape.append(array.type.list_size)
        array = array.flatten()
    return np.ascontiguousarray(array.to_numpy(zero_copy_only=True).reshape(shape))


class StringColumn:
    """A string column: Python ``str`` per row (None for a null), decoded per batch."""

    def __init__(self, array: pa.Array):
        self._array = array

    def take(self, rows: np.ndarray) -> list[str | None]:
        return self._array.take(rows).to_pylist()  # type: ignore[no-any-return]


class BufferColumn:
    """A binary or string column as its offsets (a numpy view) and its one data buffer."""

    def __init__(self, array: pa.Array):
        _, offsets, data = array.buffers()
        dtype = np.int64 if pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type) else np.int32
        self._offsets = np.frombuffer(offsets, dtype)[array.offset : array.offset + len(array) + 1]
        self._data = data if data is not None else pa.py_buffer(b"")
        self._valid = array.is_valid().to_numpy(zero_copy_only=False) if array.null_count else None

    def take(self, rows: np.ndarray) -> list[pa.Buffer | None]:
        """Zero-copy slices of the data buffer for ``rows``; None where a row is null."""
        starts, ends = self._offsets[rows].tolist(), self._offsets[rows + 1].tolist()
        slices: list[pa.Buffer | None] = [self._data.slice(s, e - s) for s, e in zip(starts, ends)]
        if self._valid is not None:
            slices = [b if ok else None for b, ok in zip(slices, self._valid[rows].tolist())]
        return slices


def _reorder(values: list[Any], back: np.ndarray, column: Column) -> Any:
    """A non-tensor column's values, gathered shard by shard, put back in the batch's row order
    (``back[i]``: where row i is among them): a list, or one Arrow array."""
    if isinstance(column, (BufferColumn, StringColumn)):
        return [values[i] for i in back.tolist()]
    if not values:
        return column.slice(0, 0) if isinstance(column, pa.Array) else []
    joined = pa.concat_arrays(values) if len(values) != 1 else values[0]
    return joined.take(pa.array(back))


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
