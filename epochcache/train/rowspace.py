"""RowSpace: a batch's rows of one fixed-width column, from any number of mapped shards, in one numpy call.

In: for each shard held open, its column as a C-contiguous numpy view of shape ``(rows, *item_shape)``
(zero-copy, into the shard's mapping); each row's shard number and row within that shard, which
:meth:`RowSpace.positions` turns into positions (or :meth:`RowSpace.plan`, for a whole run of batches
at once). Out, per batch of positions (:meth:`RowSpace.rows_at`, :meth:`RowPlan.rows`): a fresh
C-contiguous array of shape ``(batch rows, *item_shape)``, in the batch's order.

How: one read-only numpy array spans the address range of the shards added, as rows of ``row_bytes``
bytes (shape ``(span, row_bytes)``, uint8) with a stride of one byte, so row ``p`` is the ``row_bytes``
bytes that start ``p`` bytes after the range's start. A row's position is its shard's base address
plus ``row * row_bytes``: a batch is then one vectorised add and one fancy index (a ``memcpy`` per
row in numpy's C loop, which releases the GIL: two threads gather two batches at once), whatever the
number of shards it touches. (A ``numpy.take`` per shard costs a few microseconds of Python per
shard touched: on small shards that, not the copy, bounded throughput. A view of ``V<row bytes>``
elements, the old way, held the GIL through the copy.) The view's size, span x row bytes, must fit
in 63 bits: for rows up to 32 KB it spans the whole user address range at once (so adding a shard
costs a store, not a new view: on 4,000 small shards a view per add cost ~15% of the epoch); for
longer rows it spans as much around the mappings added as fits (tens of terabytes for 150 KB rows;
mappings lie close together), and is made again, wider, for a mapping outside it.

Positions are relative to the span's start, which moves when a shard mapped below it is added:
:meth:`RowSpace.plan` keeps the positions of many batches together with the view they were
computed for (a :class:`RowPlan`), so they stay right, and can be gathered on another thread,
whatever is added meanwhile.

Invariant: a shard's base address is in the table only between :meth:`add` and :meth:`drop`, its
owner keeps the view given to ``add`` (and so the mapping) alive in between, and uses positions (and
plans) only while their shards stay added, so a gather never reads memory that is not mapped. The
span may cover unmapped gaps between mappings: no position inside them is ever formed.
"""

from __future__ import annotations

import math
import mmap
import warnings

import numpy as np
import torch

_NOT_HELD = 0
# The user address range of x86-64 and arm64 processes with 4-level page tables, where every mapping
# lies (a mapping outside it widens the span), and the most bytes a view may span times its row bytes.
_BOTTOM, _TOP = mmap.PAGESIZE, 1 << 47
_MOST_VIEW_BYTES = 1 << 62


class RowSpace:
    """Rows of ``dtype`` and ``item_shape`` from the columns of ``shards`` shards (by shard number)."""

    def __init__(self, shards: int, dtype: np.dtype, item_shape: tuple[int, ...]):
        self.dtype, self.item_shape = np.dtype(dtype), tuple(item_shape)
        self.row_bytes = self.dtype.itemsize * math.prod(self.item_shape)
        self._base = np.full(shards, _NOT_HELD, np.int64)  # address of each held shard's row 0
        self._low = self._high = 0  # the span [low, high) of the view, holding every column added
        self._space = _rows_view(0, 0, self.row_bytes)
        self._torch_rows: torch.Tensor | None = None  # the span as torch sees it, made on first use

    def add(self, shard: int, column: np.ndarray) -> None:
        """Hold ``column`` (rows of this space's dtype and item shape, C-contiguous) as shard ``shard``'s."""
        if column.dtype != self.dtype or column.shape[1:] != self.item_shape or not column.flags.c_contiguous:
            raise ValueError(
                f"shard {shard}: a column of {column.dtype} {column.shape[1:]} (contiguous: "
                f"{column.flags.c_contiguous}) in a space of {self.dtype} {self.item_shape}"
            )
        if not len(column) or not self.row_bytes:
            return  # no row to read: its base stays unset, and no batch asks for its rows
        start = column.__array_interface__["data"][0]
        end = start + column.nbytes
        self._base[shard] = start
        if self._high == 0 or start < self._low or end > self._high:
            self._low, self._high = self._span_for(start, end)
            self._space, self._torch_rows = _rows_view(self._low, self._high, self.row_bytes), None

    def _span_for(self, start: int, end: int) -> tuple[int, int]:
        """The span of a new view holding ``[start, end)`` and every column added: as wide as fits."""
        low, high = (start, end) if self._high == 0 else (min(self._low, start), max(self._high, end))
        room = _MOST_VIEW_BYTES // self.row_bytes
        if room >= max(high, _TOP) - min(low, _BOTTOM):
            return min(low, _BOTTOM), max(high, _TOP)
        low = max(_BOTTOM, low - max(room - (high - low), 0) // 2)
        return low, max(high, min(low + room, _TOP))

    def drop(self, shard: int) -> None:
        """Forget shard ``shard``'s column: call before letting its view go."""
        self._base[shard] = _NOT_HELD

    def positions(self, shard_of: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Where the rows ``local[i]`` of shards ``shard_of[i]`` are, for :meth:`rows_at`: only for shards
        added (the caller checks), and valid until one of them is dropped or another shard is added."""
        return self._base[shard_of] - self._low + local * self.row_bytes  # type: ignore[no-any-return]

    def plan(self, shard_of: np.ndarray, local: np.ndarray) -> RowPlan:
        """The rows ``local[i]`` of shards ``shard_of[i]`` (added), located once for gathering by
        slices: valid, on any thread, until one of their shards is dropped."""
        return RowPlan(self._space, self.positions(shard_of, local), self.dtype, self.item_shape)

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        """The rows at ``positions`` (from :meth:`positions`, their shards still added), copied in that
        order into a fresh C-contiguous array of shape ``(len(positions), *item_shape)``: one numpy call."""
        return _gather(self._space, positions, self.dtype, self.item_shape)

    def rows_into(self, positions: np.ndarray, out: np.ndarray) -> None:
        """The rows at ``positions`` (as for :meth:`rows_at`) copied in that order into ``out``, a
        C-contiguous array of ``len(positions)`` rows of this space's dtype and item shape.

        The copy is torch's ``index_select``, which releases the GIL (numpy's gather of a batch holds
        it): meant for DataLoader workers, which run one intra-op thread, where the thread sending the
        last batch to the trainer then runs beside it. (In the trainer torch would split the copy over
        its intra-op threads, which then spin between batches.)"""
        if not len(positions) or not self.row_bytes:
            return
        rows = torch.from_numpy(out.reshape(len(positions), -1).view(np.uint8))
        torch.index_select(self._rows_as_torch(), 0, torch.from_numpy(positions), out=rows)

    def _rows_as_torch(self) -> torch.Tensor:
        """The span as a 2-D torch uint8 tensor, row ``p`` the ``row_bytes`` bytes at position ``p``."""
        if self._torch_rows is None:
            with warnings.catch_warnings():  # read-only memory: torch warns, and it is only ever read from
                warnings.simplefilter("ignore", UserWarning)
                self._torch_rows = torch.from_numpy(self._space)
        return self._torch_rows


class RowPlan:
    """Rows located by :meth:`RowSpace.plan`, with the view of the span they were located in."""

    def __init__(self, space: np.ndarray, positions: np.ndarray, dtype: np.dtype, item_shape: tuple[int, ...]):
        self._space, self._positions, self._dtype, self._item_shape = space, positions, dtype, item_shape

    def rows(self, start: int, end: int) -> np.ndarray:
        """Rows ``start:end`` of the plan, copied into a fresh C-contiguous array (as :meth:`RowSpace.rows_at`)."""
        return _gather(self._space, self._positions[start:end], self._dtype, self._item_shape)


def _gather(space: np.ndarray, positions: np.ndarray, dtype: np.dtype, item_shape: tuple[int, ...]) -> np.ndarray:
    """The rows of ``space`` (from :func:`_rows_view`) at ``positions``, as ``(len(positions), *item_shape)``."""
    if not space.shape[1]:
        return np.empty((len(positions), *item_shape), dtype)
    return space[positions].view(dtype).reshape(len(positions), *item_shape)  # type: ignore[no-any-return]


def _rows_view(low: int, high: int, row_bytes: int) -> np.ndarray:
    """The bytes ``[low, high)`` as a read-only uint8 array of shape ``(positions, row_bytes)``, row ``p``
    the ``row_bytes`` bytes from ``low + p`` (rows overlap: strides of one byte); no row for an empty
    span. Creating it touches no memory."""
    positions = max(high - low - row_bytes + 1, 0) if high > low else 0

    class _Interface:
        __array_interface__ = {
            "data": (low, True), "shape": (positions, row_bytes), "strides": (1, 1), "typestr": "|u1", "version": 3,
        }

    return np.asarray(_Interface())
