"""ShardSetDataset: a map-style torch Dataset over memory-mapped Arrow shards.

Per process, shards are memory-mapped on demand and kept in a bounded least-recently-used set
(:class:`epochcache.train.mappings.ShardMaps`, ``max_open_shards``), so any number of shards stays under
the kernel's map limit. Every fixed-width column (numbers, fixed-size lists, the fixed-shape tensor
type) is viewed as one read-only numpy array of shape ``(rows, *item_shape)`` that points into the
mapping: opening costs no copy and no per-sample object. A batch (``__getitems__``) is gathered with
one ``numpy.take`` per shard touched, straight into the batch's freshly allocated array, which torch
then wraps without a copy: one copy in all, the gather itself. Samples of a batch are grouped by
shard (stable within a shard), which keeps that copy single; the batch is the same set of samples
the sampler chose, less the rows of a shard that cannot be read.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from epochcache.cache.columns import is_binary, is_fixed_width, is_string
from epochcache.errors import LoaderError, ShardCorruptError
from epochcache.sources.base import KEY_COLUMN
from epochcache.train.mappings import DEFAULT_MAX_OPEN_SHARDS, ShardMaps
from epochcache.train.shardplan import ShardPlan, open_planned

log = logging.getLogger(__name__)

# Column name -> a tensor, a list of str or of pyarrow.Buffer, or a pyarrow array (by the column's
# type, see the module docstring): Any, so that callers index a batch without narrowing a union.
Batch = dict[str, Any]
Column = Union[np.ndarray, pa.Array, "BufferColumn", "StringColumn"]
Views = dict[str, Column]


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
        self._unreadable: set[int] = set()
        self._key = None if self._columns is None else tuple(self._columns)
        # A dataset of at most max_open_shards shards also holds its views itself, by shard number:
        # the gather then skips the shared LRU's lock and bookkeeping, once per shard touched per batch.
        # Its mappings stay within the bound; a larger dataset goes through the LRU every time.
        fits = len(self._paths) <= self._max_open
        self._held: list[Views | None] | None = [None] * len(self._paths) if fits else None
        # A larger dataset maps shards again as the LRU drops them: it keeps where each shard's columns
        # lie (epochcache.train.shardplan), so mapping one again skips the IPC parsing.
        self._plans: dict[str, ShardPlan] | None = None if fits else {}

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        held = None if self._held is None else [None] * len(self._held)
        plans: dict[str, ShardPlan] | None = None if self._plans is None else {}
        return {**self.__dict__, "_maps": None, "_template": None, "_held": held, "_plans": plans}

    def __getitem__(self, index: int) -> Batch:
        batch = self.__getitems__([index])
        return {name: value[0] for name, value in batch.items()}

    def __getitems__(self, indices: Sequence[int] | np.ndarray, out: dict[str, np.ndarray] | None = None) -> Batch:
        """The rows at ``indices`` as one batch: tensors of shape ``(rows, *item_shape)``; ``rows`` is
        ``len(indices)`` less the rows of unreadable shards.

        ``out`` (fixed-width column -> array of at least ``len(indices)`` rows of its dtype and item
        shape, as :meth:`fixed_layout` gives) receives those columns instead of fresh arrays; their
        tensors then share its memory."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"index out of range for a dataset of {len(self)} samples")
        shard_of = np.searchsorted(self._offsets, idx, side="right") - 1
        order = np.argsort(shard_of, kind="stable")
        shard_of = shard_of[order]
        local = idx[order] - self._offsets[shard_of]
        splits = np.flatnonzero(np.diff(shard_of)).tolist()
        starts, ends = [0, *(i + 1 for i in splits)], [*(i + 1 for i in splits), idx.size]
        template = self._reference()
        given = out or {}
        result: dict[str, Any] = {
            name: (given[name][: idx.size] if name in given else np.empty((idx.size, *col.shape[1:]), col.dtype))
            if isinstance(col, np.ndarray) else []
            for name, col in template.items()
        }
        # The hot loop of the loader: one gather per shard and column, as few Python steps as possible.
        # mode="clip" (indices are checked above): under the default mode="raise" numpy gathers into a
        # temporary and copies that into ``result``, which costs a second copy of every batch.
        filled = 0  # rows written: unreadable shards' rows are skipped, so arrays stay dense from 0
        for start, end in zip(starts, ends):
            views = self._views(int(shard_of[start]))
            if views is None:
                continue
            rows, stop = local[start:end], filled + end - start
            for name, col in views.items():
                if isinstance(col, np.ndarray):
                    col.take(rows, axis=0, out=result[name][filled:stop], mode="clip")
                elif isinstance(col, (BufferColumn, StringColumn)):
                    result[name].extend(col.take(rows))
                else:
                    result[name].append(col.take(pa.array(rows)))
            filled = stop
        return {name: _finish(value, template[name], filled) for name, value in result.items()}

    def fixed_layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The fixed-width (tensor) columns, as name -> (dtype, item shape), of the dataset's schema
        (every shard's, see the class docstring); empty for an empty dataset."""
        if not self._paths:
            return {}
        template = self._reference()
        return {name: (col.dtype, col.shape[1:]) for name, col in template.items() if isinstance(col, np.ndarray)}

    def _reference(self) -> Views:
        """The views of the first readable shard, whose column types every other shard must share."""
        if self._template is None:
            for number in range(len(self._paths)):
                views = self._views(number)
                if views is not None:
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
        if self._held is not None and self._held[number] is not None:
            return self._held[number]
        if number in self._unreadable:
            return None
        if self._maps is None:
            self._maps = ShardMaps(self._max_open)
        path = self._paths[number]
        try:
            views = self._maps.get((path, self._key), lambda: self._open_one(path))
        except (ShardCorruptError, FileNotFoundError) as exc:
            self._unreadable.add(number)
            log.warning("shard %s cannot be read, its rows are left out of this epoch: %s", path, exc)
            if self._on_unreadable is not None:
                self._on_unreadable(path, exc)
            return None
        if self._held is not None:
            self._held[number] = views
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


def _describe(types: dict[str, pa.DataType]) -> str:
    return "[" + ", ".join(f"{name}: {kind}" for name, kind in types.items()) + "]"


def _numpy_view(array: pa.Array) -> np.ndarray:
    """A zero-copy ``(rows, *item_shape)`` numpy view of a fixed-width column without nulls."""
    if isinstance(array.type, pa.FixedShapeTensorType):
        return array.to_numpy_ndarray()
    shape = [len(array)]
    while pa.types.is_fixed_size_list(array.type):
        shape.append(array.type.list_size)
        array = array.flatten()
    return array.to_numpy(zero_copy_only=True).reshape(shape)


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


def _finish(value: Any, column: Column, rows: int) -> Any:
    """The batch value of one column (its first ``rows`` rows): a tensor, a list, or one Arrow array."""
    if isinstance(column, np.ndarray):
        return torch.from_numpy(value[:rows])
    if isinstance(column, (BufferColumn, StringColumn)):
        return value
    if not value:
        return column.slice(0, 0)
    return pa.concat_arrays(value) if len(value) != 1 else value[0]
