"""Worker batches through a ring of shared-memory slots instead of the result pipe.

A DataLoader worker sends its batch through a pipe, pickled (:mod:`epochcache.train.wire`): about 400 MB/s
here, the bottleneck of worker mode. For the common batch, whose numeric columns have the shape and
dtype of the dataset's fixed-width columns, this ring skips the pipe. The ring is ``count`` slots of
anonymous shared memory: no name in /dev/shm, so nothing can collide with it or leak after a crash;
it is gone when the last process unmaps it (and closes its file). The workers fork before the
dataset's columns, hence the slots' size, are known (they start while the loader waits for the first
shard), so the trainer makes the memory as a file (:func:`shared_memory`, a memfd) that they inherit,
sizes and maps it once the layout is known, and sends them the ring with their first epoch: a ring
pickles as its layout and that file's descriptor, which the workers map on arrival (without
resetting it). Batch ``number`` goes to slot ``number % count``: the worker
gathers it there (straight from the shards when there is no transform) and sends back only a small
:class:`SlotBatch`; the trainer copies its arrays out into fresh tensors (page-locked ones, when pinning:
one copy, not a copy and a pin) and frees the slot. So a batch the trainer holds never lives in the ring, and the
ring's lifetime does not reach user code.

Invariant: a slot is never written while a batch in it is unread. Each slot has a shared int64, the
one batch number allowed to write it next; the trainer raises it by ``count`` only after copying the
slot out, or once that batch came through the pipe instead. A worker whose slot is not free yet (the
DataLoader fetches further ahead than the ring holds) sends that batch through the pipe: it never
waits and never overwrites. A batch that does not fit the slots (a transform that changes shapes or
dtypes) also goes through the pipe, as do the batches before the ring's first.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from epochcache.train.device import pinned_copy
from epochcache.train.wire import from_wire, tensor_as_numpy, to_wire

# Column starts aligned to a cache line, so each gather writes whole lines of its own column.
_ALIGN = 64

Layout = Mapping[str, tuple[np.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class SlotBatch:
    """What a worker sends for a batch written into its slot: the numbers and the other columns."""

    number: int
    rows: int
    extras: dict[str, Any]


def shared_memory() -> int:
    """A new, empty anonymous shared-memory file (its descriptor, closed by the caller) to hold a
    :class:`SlotRing`: processes forked after this inherit it, so a ring made in it later reaches them.
    Close-on-exec: a program the trainer runs never holds it."""
    return os.memfd_create("epochcache-slots", os.MFD_CLOEXEC)


def free_shared_memory(fd: int) -> None:
    """Free a ring's memory (its file cut to nothing) and close ``fd``, once no process reads or
    writes the ring again (its workers stopped, its batches copied out: a process touching it after
    would get SIGBUS). Closing alone frees nothing while another process holds the file: the workers
    of a pool forked while this one lived inherited it, and this process's own mapping holds a copy
    of the descriptor until it is collected."""
    os.ftruncate(fd, 0)
    os.close(fd)


class SlotRing:
    """``count`` slots, each holding ``batch_size`` rows of every column of ``layout`` (name -> dtype,
    item shape); ``first`` is the epoch's first batch number (a resumed epoch starts later).

    ``fd``: the :func:`shared_memory` to hold it, sized here; the ring then pickles (as its layout and
    ``fd``) for the processes forked after ``fd`` was made, which map the same slots. None: memory of
    its own, reaching other processes only through a fork after this."""

    def __init__(self, layout: Layout, batch_size: int, count: int, first: int = 0, fd: int | None = None,
                 *, _attach: bool = False):
        self._layout = {name: (np.dtype(dtype), tuple(shape)) for name, (dtype, shape) in layout.items()}
        self._batch_size, self._count, self._fd = batch_size, count, fd
        offsets, size = {}, 0
        for name, (dtype, shape) in self._layout.items():
            offsets[name] = size
            size += -(-batch_size * math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        self._offsets, self._slot_bytes = offsets, size
        header = -(-count * 8 // _ALIGN) * _ALIGN
        total = header + count * size
        if fd is None:
            self._memory = mmap.mmap(-1, total)
        else:
            if not _attach:
                os.ftruncate(fd, total)
            self._memory = mmap.mmap(fd, total)
        self._header = header
        self._next_writer = np.frombuffer(self._memory, np.int64, count)
        if not _attach:  # (a worker attaching finds the numbers the trainer keeps)
            # batch first + k writes slot (first + k) % count first: the smallest such number per slot
            self._next_writer[:] = first + (np.arange(count) - first) % count

    def __reduce__(self) -> tuple[Any, ...]:
        if self._fd is None:
            raise TypeError("a SlotRing in memory of its own reaches other processes through fork only: "
                            "make it with fd=shared_memory() before they fork to send it")
        return _attached, (self._layout, self._batch_size, self._count, self._fd)

    def claim(self, number: int) -> dict[str, np.ndarray] | None:
        """In a worker: the full-size arrays of batch ``number``'s slot, or None while it is still in use."""
        slot = number % self._count
        if int(self._next_writer[slot]) != number:
            return None
        return self._arrays(slot)

    def fits(self, batch: Any) -> bool:
        """Whether ``batch`` (a dict) holds every slot column as a CPU tensor of the slot's dtype and
        item shape, all with the same number of rows, at most ``batch_size``. (A numpy array does not
        fit: the slot would hand it back as a tensor.)"""
        if not isinstance(batch, dict):
            return False
        rows = set()
        for name, (dtype, shape) in self._layout.items():
            value = tensor_as_numpy(batch.get(name))
            if value is None or value.ndim == 0 or value.dtype != dtype or value.shape[1:] != shape:
                return False
            rows.add(len(value))
        return len(rows) == 1 and rows.pop() <= self._batch_size

    def send(self, number: int, batch: Any) -> SlotBatch | None:
        """In a worker: ``batch`` copied into its slot, or None if it does not fit or the slot is in use."""
        if not self.fits(batch):
            return None
        slot = self.claim(number)
        if slot is None:
            return None
        rows = len(batch[next(iter(self._layout))])
        for name in self._layout:
            np.copyto(slot[name][:rows], np.asarray(batch[name]))
        return self.sent(number, rows, batch)

    def sent(self, number: int, rows: int, batch: Mapping[str, Any]) -> SlotBatch:
        """The message for batch ``number`` once its ``rows`` rows are in the slot; the rest of ``batch``
        travels in it as numpy (see :mod:`epochcache.train.wire`)."""
        return SlotBatch(number, rows, to_wire({k: v for k, v in batch.items() if k not in self._layout}))

    def receive(self, message: Any, number: int, pinned: bool = False) -> Any:
        """In the trainer: batch ``number`` as tensors of its own (copied out of the slot straight into
        page-locked memory when ``pinned``); frees its slot. Anything but a
        :class:`SlotBatch` came through the pipe and is only unwrapped: the slot is passed on to the
        batch after, had it waited for this one (else it would wait for ever, and every batch of that
        slot after it take the pipe)."""
        if not isinstance(message, SlotBatch):
            slot = number % self._count
            if int(self._next_writer[slot]) == number:
                self._next_writer[slot] = number + self._count
            return from_wire(message)
        slot = message.number % self._count
        arrays = self._arrays(slot)
        batch = {name: _copied(array[: message.rows], pinned) for name, array in arrays.items()}
        # only now may the batch count slots later overwrite this one
        self._next_writer[slot] = message.number + self._count
        return {**batch, **from_wire(message.extras)}

    def _arrays(self, slot: int) -> dict[str, np.ndarray]:
        base = self._header + slot * self._slot_bytes
        return {
            name: np.frombuffer(
                self._memory, dtype, self._batch_size * math.prod(shape), base + self._offsets[name]
            ).reshape(self._batch_size, *shape)
            for name, (dtype, shape) in self._layout.items()
        }


def _copied(rows: np.ndarray, pinned: bool) -> torch.Tensor:
    """A tensor of its own holding ``rows`` (a slot's): one copy, into pinned memory when ``pinned``."""
    return pinned_copy(rows) if pinned else torch.from_numpy(rows.copy())


def layout_of(batch: Any) -> Layout:
    """The slot layout of batches like ``batch`` (a dict): its numeric CPU tensors numpy can hold
    (bool, integer, float, complex) with as many rows as the first of them, by name, as (dtype, item
    shape); empty if there is none. A column left out (another type, a numpy array, 0-d, other rows)
    travels through the pipe with the rest of the batch, as it was made."""
    layout: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    rows = None
    for name, value in batch.items() if isinstance(batch, dict) else ():
        array = tensor_as_numpy(value)
        if array is None or array.ndim == 0 or array.dtype.kind not in "biufc":
            continue
        if rows is None:
            rows = len(array)
        if len(array) == rows:
            layout[name] = (array.dtype, array.shape[1:])
    return layout


def _attached(layout: Layout, batch_size: int, count: int, fd: int) -> SlotRing:
    """In a process forked after ``fd`` was made: the ring the trainer made in it (see SlotRing.__reduce__)."""
    return SlotRing(layout, batch_size, count, fd=fd, _attach=True)
