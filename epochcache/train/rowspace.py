"""RowSpace: a batch's rows of one fixed-width column, from any number of mapped shards, in one numpy call.

In: for each shard held open, its column as a C-contiguous numpy view of shape ``(rows, *item_shape)``
(zero-copy, into the shard's mapping); each row's shard number and row within that shard, which
:meth:`RowSpace.positions` turns into positions (for a whole run of batches at once, if wanted).
Out, per batch of positions (:meth:`RowSpace.rows_at`): a fresh C-contiguous array of shape
``(batch rows, *item_shape)``, in the batch's order.

How: one read-only numpy array spans the whole user address range, with dtype ``V<row bytes>`` and
a stride of one byte, so the element at position ``p`` is the row that starts ``p`` bytes after the
range's start. A row's position is its shard's base address plus ``row * row_bytes``: a batch is
then one vectorised add and one fancy index (a ``memcpy`` per row in numpy's C loop), whatever the
number of shards it touches. (A ``numpy.take`` per shard costs a few microseconds of Python per
shard touched: on small shards that, not the copy, bounded throughput.)

Invariant: a shard's base address is in the table only between :meth:`add` and :meth:`drop`, its
owner keeps the view given to ``add`` (and so the mapping) alive in between, and uses positions only
while their shards stay added, so a gather never reads memory that is not mapped. The span may cover
unmapped gaps between mappings: no position inside them is ever formed.
"""

from __future__ import annotations

import math
import mmap
import warnings

import numpy as np
import torch

_NOT_HELD = 0
# The span a space starts with: the user address range of x86-64 and arm64 processes with 4-level page
# tables, where every mapping lies; so adding a shard costs a store, not a new view (a mapping outside
# it widens the span).
_FIRST_SPAN = (mmap.PAGESIZE, 1 << 47)


class RowSpace:
    """Rows of ``dtype`` and ``item_shape`` from the columns of ``shards`` shards (by shard number)."""

    def __init__(self, shards: int, dtype: np.dtype, item_shape: tuple[int, ...]):
        self.dtype, self.item_shape = np.dtype(dtype), tuple(item_shape)
        self.row_bytes = self.dtype.itemsize * math.prod(self.item_shape)
        self._base = np.full(shards, _NOT_HELD, np.int64)  # address of each held shard's row 0
        self._low, self._high = _FIRST_SPAN  # the span [low, high) of the view, holding every column added
        self._space = self._view()
        self._torch_rows: torch.Tensor | None = None  # the span as torch sees it, made on first use
        # viewing a gathered V<row_bytes> array as this dtype gives it the shape (rows, *item_shape)
        self._rows = np.dtype((self.dtype, self.item_shape)) if self.item_shape else self.dtype

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
        if start < self._low or end > self._high:
            self._low, self._high = min(self._low, start), max(self._high, end)
            self._space, self._torch_rows = self._view(), None

    def _view(self) -> np.ndarray:
        """The span as elements of ``row_bytes`` bytes, element ``p`` starting ``p`` bytes into it (they
        overlap: stride one byte; at least one byte each: a dtype needs a size)."""
        size = max(self.row_bytes, 1)
        return _strided(self._low, (self._high - self._low - size + 1,), (1,), f"|V{size}")

    def drop(self, shard: int) -> None:
        """Forget shard ``shard``'s column: call before letting its view go."""
        self._base[shard] = _NOT_HELD

    def positions(self, shard_of: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Where the rows ``local[i]`` of shards ``shard_of[i]`` are, for :meth:`rows_at`: only for shards
        added (the caller checks), and valid until one of them is dropped."""
        return self._base[shard_of] - self._low + local * self.row_bytes  # type: ignore[no-any-return]

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        """The rows at ``positions`` (from :meth:`positions`, their shards still added), copied in that
        order into a fresh C-contiguous array of shape ``(len(positions), *item_shape)``: one numpy call."""
        if not self.row_bytes:
            return np.empty((len(positions), *self.item_shape), self.dtype)
        return self._space[positions].view(self._rows)  # type: ignore[no-any-return]

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
            rows = _strided(self._low, (self._high - self._low - self.row_bytes + 1, self.row_bytes), (1, 1), "|u1")
            with warnings.catch_warnings():  # read-only memory: torch warns, and it is only ever read from
                warnings.simplefilter("ignore", UserWarning)
                self._torch_rows = torch.from_numpy(rows)
        return self._torch_rows


def _strided(address: int, shape: tuple[int, ...], strides: tuple[int, ...], typestr: str) -> np.ndarray:
    """A read-only numpy array of ``typestr`` elements, ``shape`` and ``strides`` (in bytes) at
    ``address``. Creating it touches no memory."""

    class _Interface:
        __array_interface__ = {
            "data": (address, True), "shape": shape, "strides": strides, "typestr": typestr, "version": 3,
        }

    return np.asarray(_Interface())
