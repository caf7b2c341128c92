"""ShardSetDataset: a map-style torch Dataset over memory-mapped Arrow shards.

Per process, each shard is memory-mapped once and every fixed-width column (numbers, fixed-size
lists, the fixed-shape tensor type) is viewed as one read-only numpy array of shape
``(rows, *item_shape)`` that points into the mapping: opening costs no copy and no per-sample object.
A batch (``__getitems__``) is gathered with one ``numpy.take`` per shard touched, straight into the
batch's freshly allocated array, which torch then wraps without a copy: one copy in all, the gather
itself. Samples of a batch are grouped by shard (stable within a shard), which keeps that copy
single; the batch is the same set of samples the sampler chose.

Variable-size binary and string columns come out as a list of ``pyarrow.Buffer`` per batch, one per
sample (None for a null), each a zero-copy slice of the mapped file, for a user decode function (see
:mod:`epochcache.transform`). Other columns (nested variable lists, structs) come out as pyarrow
arrays taken per batch. Neither keeps a Python object per sample in the dataset. Which kind a column is follows from its type alone, so it
is the same in every batch; nulls in a fixed-width column are an error, not a silent change of kind.

Shards are opened lazily in the process that reads them, so pickling the dataset into DataLoader
workers sends paths, never data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from epochcache.columns import is_binary, is_fixed_width
from epochcache.errors import LoaderError
from epochcache.shards import open_shard
from epochcache.sources.base import KEY_COLUMN

Batch = dict[str, torch.Tensor | pa.Array | list[pa.Buffer | None]]
Column = Union[np.ndarray, pa.Array, "BufferColumn"]


class ShardSetDataset(Dataset[Batch]):
    """Rows of ``paths`` (with ``rows[i]`` rows each) in order; ``columns`` None = all but the key."""

    def __init__(
        self, paths: Sequence[Path], rows: Sequence[int], columns: Sequence[str] | None = None,
        opened: OpenShards | None = None,
    ):
        """``opened``: shards already mapped in this process by an earlier dataset with the same
        ``columns`` (a loader's consecutive epochs), reused instead of mapped again."""
        if len(paths) != len(rows):
            raise ValueError(f"{len(paths)} shard paths but {len(rows)} row counts")
        self._paths = [str(p) for p in paths]
        self._offsets = np.concatenate([[0], np.cumsum(np.asarray(rows, dtype=np.int64))])
        self._columns = list(columns) if columns is not None else None
        self._views: list[dict[str, Column]] | None = None
        self._opened = opened

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_views": None, "_opened": None}

    def __getitem__(self, index: int) -> Batch:
        batch = self.__getitems__([index])
        return {name: value[0] for name, value in batch.items()}

    def __getitems__(self, indices: Sequence[int] | np.ndarray, out: dict[str, np.ndarray] | None = None) -> Batch:
        """The rows at ``indices`` as one batch: tensors of shape ``(len(indices), *item_shape)``.

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
        views = self._open()
        splits = np.flatnonzero(np.diff(shard_of)).tolist()
        starts, ends = [0, *(i + 1 for i in splits)], [*(i + 1 for i in splits), idx.size]
        template = views[int(shard_of[0])] if idx.size else views[0]
        given = out or {}
        result: dict[str, Any] = {
            name: (given[name][: idx.size] if name in given else np.empty((idx.size, *col.shape[1:]), col.dtype))
            if isinstance(col, np.ndarray) else []
            for name, col in template.items()
        }
        # The hot loop of the loader: one gather per shard and column, as few Python steps as possible.
        # mode="clip" (indices are checked above): under the default mode="raise" numpy gathers into a
        # temporary and copies that into ``result``, which costs a second copy of every batch.
        for start, end in zip(starts, ends):
            rows = local[start:end]
            for name, col in views[shard_of[start]].items():
                if isinstance(col, np.ndarray):
                    col.take(rows, axis=0, out=result[name][start:end], mode="clip")
                elif isinstance(col, BufferColumn):
                    result[name].extend(col.take(rows))
                else:
                    result[name].append(col.take(pa.array(rows)))
        return {name: _finish(value, template[name]) for name, value in result.items()}

    def fixed_layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The fixed-width (tensor) columns, as name -> (dtype, item shape), read from the first shard
        alone (shards of one cache share a schema); empty for an empty dataset."""
        if not self._paths:
            return {}
        views = self._view(open_shard(Path(self._paths[0])), self._paths[0])
        return {name: (col.dtype, col.shape[1:]) for name, col in views.items() if isinstance(col, np.ndarray)}

    def _open(self) -> list[dict[str, Column]]:
        if self._views is None:
            if self._opened is None:
                self._views = [self._open_one(path) for path in self._paths]
            else:
                self._views = self._opened.views(self._paths, self._open_one)
        return self._views

    def _open_one(self, path: str) -> dict[str, Column]:
        return self._view(open_shard(Path(path)), path)

    def _view(self, table: pa.Table, path: str) -> dict[str, Column]:
        names = self._columns or [n for n in table.column_names if n != KEY_COLUMN]
        missing = [n for n in names if n not in table.column_names]
        if missing:
            raise LoaderError(f"loader.columns names {missing}, absent from shard {path}: it has {table.column_names}")
        views: dict[str, Column] = {}
        for name in names:
            column = table.column(name)
            # Shards hold one record batch, so this is the one chunk itself, not a copy.
            array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            if is_binary(array.type):
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


class OpenShards:
    """The column views of the shards the latest dataset opened in this process, by path.

    Shard file names carry their checksum, so a path always means the same bytes. Consecutive
    epochs mostly read the same shards: reusing their mappings spares re-faulting every
    page each epoch, and unmapping them (a large munmap blocks every page fault of the process for
    milliseconds). Only the latest set is kept: shards that left it stay mapped while an older
    dataset still holds them and are unmapped with it.
    """

    def __init__(self) -> None:
        self._views: dict[str, dict[str, Column]] = {}
        self._lock = threading.Lock()

    def views(self, paths: Sequence[str], open_one: Callable[[str], dict[str, Column]]) -> list[dict[str, Column]]:
        """The views of ``paths``, in order, opened with ``open_one`` where not already open."""
        with self._lock:
            known = self._views
        fresh = {path: known[path] if path in known else open_one(path) for path in paths}
        with self._lock:
            self._views = fresh
        return list(fresh.values())


def _numpy_view(array: pa.Array) -> np.ndarray:
    """A zero-copy ``(rows, *item_shape)`` numpy view of a fixed-width column without nulls."""
    if isinstance(array.type, pa.FixedShapeTensorType):
        return array.to_numpy_ndarray()
    shape = [len(array)]
    while pa.types.is_fixed_size_list(array.type):
        shape.append(array.type.list_size)
        array = array.flatten()
    return array.to_numpy(zero_copy_only=True).reshape(shape)


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


def _finish(value: Any, column: Column) -> Any:
    """The batch value of one column: a tensor, the list of buffers, or one Arrow array."""
    if isinstance(column, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(column, BufferColumn):
        return value
    return pa.concat_arrays(value) if len(value) != 1 else value[0]
