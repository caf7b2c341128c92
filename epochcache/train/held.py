"""The shards a dataset holds open in one process: mapped on demand, at most ``max_open`` at once.

In: an epoch's shard paths, the columns selected, the process's mapping set
(:class:`epochcache.train.mappings.ShardMaps`, kept across epochs) and a callback for shards that
cannot be read. Out: for the rows a batch needs, which shards can be read, each of them held
(:meth:`HeldShards.hold`): mapped, its columns viewed without a copy (fixed-width ones as numpy
arrays of shape ``(rows, *item_shape)`` pointing into the mapping, strings and binaries as
:class:`StringColumn` / :class:`BufferColumn`, nested ones as Arrow arrays) and its fixed-width
columns added to the row spaces (:mod:`epochcache.train.rowspace`) that gather a batch in one call.
The least recently read shards are dropped to stay within ``max_open``, never one of the batch
asking.

Invariants: every shard held has the column types of the first readable one (the reference); a
shard that differs is a :class:`LoaderError`, so no batch array is left partly unfilled. A shard is
dropped from the row spaces before its views go (RowSpace's invariant). What is held is per process:
pickling (into DataLoader workers) sends paths, and the receiving process maps its own.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Sequence
from typing import Any, Union

import numpy as np
import pyarrow as pa

from epochcache.arrays import numbers, numpy_view, unpacked
from epochcache.cache.columns import is_binary, is_fixed_width, is_string
from epochcache.errors import LoaderError, ShardCorruptError
from epochcache.sources.base import KEY_COLUMN
from epochcache.train.mappings import ShardMaps
from epochcache.train.rowspace import RowSpace
from epochcache.train.shardplan import ShardPlan, open_planned

log = logging.getLogger(__name__)

Column = Union[np.ndarray, pa.Array, "BufferColumn", "StringColumn"]
Views = dict[str, Column]

# A shard's state, per process: not mapped here, held (mapped, in the row spaces), unreadable.
_CLOSED, _HELD, _UNREADABLE = 0, 1, 2


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D integer array, sorted: ``np.unique``'s result. (numpy 2.x's
    ``np.unique`` imports ``numpy.ma`` on its first call in a process: measured 20 ms, paid by each
    worker process and by the trainer on the way to an epoch's first batch.)"""
    ordered = np.sort(values)
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]


class HeldShards:
    """Shards ``paths`` (by number), columns ``columns`` (None: all but the key), at most ``max_open``
    held at once; ``maps``: this process's mapping set (None: one made on first use, as in a worker,
    bounded by ``max_open`` and ``max_mapped``, see :class:`ShardMaps`); ``on_unreadable(path, error)``
    told of each shard that cannot be read (left out from then on)."""

    def __init__(
        self, paths: Sequence[str], columns: Sequence[str] | None, maps: ShardMaps[Views] | None, max_open: int,
        on_unreadable: Callable[[str, Exception], None] | None, max_mapped: int | None = None,
    ):
        self._paths = list(paths)
        self._columns = list(columns) if columns is not None else None
        self._maps: ShardMaps[Views] | None = None
        self.max_open = max_open
        self.max_mapped = max_mapped
        self._on_unreadable = on_unreadable
        self._schema: dict[str, pa.DataType] | None = None  # name -> type, from the first readable shard
        self._schema_path = ""
        self._template: Views | None = None
        self._key = None if self._columns is None else tuple(self._columns)
        # More shards than max_open are mapped again as they are dropped: where each shard's columns lie
        # is kept (epochcache.train.shardplan), so mapping one again skips the IPC parsing.
        self._plans: dict[str, ShardPlan] | None = None if len(self._paths) <= self.max_open else {}
        self._reset()
        if maps is not None:
            self.use_maps(maps)

    def _reset(self) -> None:
        """Nothing held: the per-process state (mappings and their addresses) starts empty."""
        self._held: dict[int, Views] = {}
        self.spaces: dict[str, RowSpace] = {}  # one per fixed-width column, made with the reference
        self._state = np.full(len(self._paths), _CLOSED, np.int8)
        self._last_used = np.zeros(len(self._paths), np.int64)  # the batch count when a shard was last read
        self._batches = 0

    def __getstate__(self) -> dict[str, Any]:
        held = ("_held", "spaces", "_state", "_last_used", "_batches")
        plans: dict[str, ShardPlan] | None = None if self._plans is None else {}
        state = {k: v for k, v in self.__dict__.items() if k not in held}
        return {**state, "_maps": None, "_template": None, "_plans": plans}  # the spaces go with the template

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def count(self) -> int:
        """Shards in all, held or not."""
        return len(self._paths)

    def use_maps(self, maps: ShardMaps[Views]) -> None:
        """Map shards through ``maps`` (a process's set, kept across epochs) from now on, these shards
        being the newest epoch's: the mappings of any other shard are dropped from the set."""
        self._maps = maps
        if len(maps):  # (none on a first epoch: its set of keys, 150 ms for 100,000 shards, is not made)
            maps.retain({(path, self._key) for path in self._paths})

    def trim(self) -> None:
        """Let the mapped shards' pages go if past ``max_mapped`` (:meth:`ShardMaps.trim`): once per
        batch, on the thread building it."""
        if self._maps is not None:
            self._maps.trim()

    def held(self, number: int) -> Views:
        """The views of shard ``number``, held (by :meth:`hold`, for the batch being built)."""
        return self._held[number]

    def hold(self, shard_of: np.ndarray) -> np.ndarray:
        """Whether each row's shard can be read; every readable one is held (mapped and in the row
        spaces) when this returns, shards least recently read dropped to stay within ``max_open_shards``."""
        self._batches += 1
        self._last_used[shard_of] = self._batches
        closed = self._state[shard_of] == _CLOSED
        if closed.any():  # (most batches: none; distinct costs even on nothing)
            missing = distinct(shard_of[closed])
            self._make_room(missing.size)
            for number in missing.tolist():
                self._open_into(number)
        return self._state[shard_of] == _HELD

    def _make_room(self, wanted: int) -> None:
        """Drop the least recently read held shards (never one of this batch) so ``wanted`` more fit."""
        excess = len(self._held) + wanted - self.max_open
        if excess <= 0:
            return
        held = np.fromiter(self._held, np.int64, len(self._held))
        ages = self._last_used[held]
        victims = held[np.argsort(ages, kind="stable")[:excess]]
        for number in victims[self._last_used[victims] < self._batches].tolist():
            for space in self.spaces.values():
                space.drop(number)  # before the views go: see RowSpace's invariant
            del self._held[number]
            self._state[number] = _CLOSED

    def _open_into(self, number: int) -> None:
        """Map shard ``number`` (or mark it unreadable) and put its fixed-width columns in the row spaces."""
        views = self.views(number)
        if views is None:
            return
        for name, space in self.spaces.items():
            space.add(number, views[name])  # type: ignore[arg-type]  # fixed-width: numpy, per the schema check
        self._held[number] = views
        self._state[number] = _HELD

    def fixed_layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The fixed-width (tensor) columns, as name -> (dtype, item shape), of the dataset's schema
        (every shard's, see the class docstring); empty for an empty dataset."""
        if not self._paths:
            return {}
        template = self.reference()
        return {name: (col.dtype, col.shape[1:]) for name, col in template.items() if isinstance(col, np.ndarray)}

    def reference(self) -> Views:
        """The views of the first readable shard, whose column types every other shard must share; the
        row spaces of its fixed-width columns are made with it."""
        if self._template is None:
            for number in range(len(self._paths)):
                views = self.views(number)
                if views is not None:
                    self.spaces = {name: RowSpace(len(self._paths), col.dtype, col.shape[1:])
                                    for name, col in views.items() if isinstance(col, np.ndarray)}
                    self._template = views
                    break
            else:
                raise LoaderError(
                    f"none of the {len(self._paths)} shards of this epoch can be read (see the log for why; "
                    "they are quarantined): run `epochcache sync` to refill the cache"
                )
        return self._template

    def views(self, number: int) -> Views | None:
        """Shard ``number``'s column views, mapped if not open; None if it cannot be read."""
        if number in self._held:
            return self._held[number]
        if self._state[number] == _UNREADABLE:
            return None
        if self._maps is None:
            self._maps = ShardMaps(self.max_open, self.max_mapped)
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

    def _open_one(self, path: str) -> tuple[Views, mmap.mmap]:
        known = self._plans.get(path) if self._plans is not None else None
        if known is not None:  # mapped before and checked then: one mmap, no IPC parsing
            arrays, mapped = known.remap(path)
            return self._view(arrays, path), mapped
        arrays, schema, plan, mapped = open_planned(path)
        views = self._view(arrays, path)
        self._check_schema(schema, path)
        if self._plans is not None and plan is not None:
            self._plans[path] = plan
        return views, mapped

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
                views[name] = numpy_view(array)
        return views


def _describe(types: dict[str, pa.DataType]) -> str:
    return "[" + ", ".join(f"{name}: {kind}" for name, kind in types.items()) + "]"


class StringColumn:
    """A string column: Python ``str`` per row (None for a null), decoded per batch."""

    def __init__(self, array: pa.Array):
        self._array = array

    def take(self, rows: np.ndarray) -> list[str | None]:
        return self._array.take(numbers(rows)).to_pylist()  # type: ignore[no-any-return]


class BufferColumn:
    """A binary or string column as its offsets (a numpy view) and its one data buffer."""

    def __init__(self, array: pa.Array):
        _, offsets, data = array.buffers()
        dtype = np.int64 if pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type) else np.int32
        self._offsets = np.frombuffer(offsets, dtype)[array.offset : array.offset + len(array) + 1]
        self._data = data if data is not None else pa.py_buffer(b"")
        self._valid = unpacked(array.is_valid()) if array.null_count else None

    def take(self, rows: np.ndarray) -> list[pa.Buffer | None]:
        """Zero-copy slices of the data buffer for ``rows``; None where a row is null."""
        starts, ends = self._offsets[rows].tolist(), self._offsets[rows + 1].tolist()
        slices: list[pa.Buffer | None] = [self._data.slice(s, e - s) for s, e in zip(starts, ends)]
        if self._valid is not None:
            slices = [b if ok else None for b, ok in zip(slices, self._valid[rows].tolist())]
        return slices
