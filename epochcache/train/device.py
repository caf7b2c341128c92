"""Batches to the accelerator ahead of use: pinned host memory and a side-stream copy.

In: an iterator of batches (dicts of tensors and other values); out: the same batches with every
tensor on ``device``. On CUDA the copy of batch i+1 is issued on a side stream while batch i is in
use, and the consumer's stream waits for it (``wait_stream``) before the batch is handed out;
``record_stream`` keeps the caching allocator from reusing a batch's memory while the consumer's
stream may still read it. On the CPU both are no-ops and batches pass through untouched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import torch

from epochcache.train.wire import tensor_as_numpy

log = logging.getLogger(__name__)


def pin_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """Tensors of ``batch`` in page-locked memory (what makes a host->GPU copy asynchronous), each
    copied by numpy on the calling thread (:func:`pinned_copy`). Not torch's
    ``pin_memory()``: it spreads the copy over every intra-op thread, which then spin between
    batches (on a 16-core H200 host, 68-102 µs of the trainer's CPU per 12 KB sample against 5.2-7.5
    this way, with as many batches per second or more: README, ``benchmarks/device.py``). A tensor already
    pinned, or not on the CPU, is kept; one numpy cannot view (bfloat16, requiring grad) goes through
    ``pin_memory()``."""
    return {name: _pinned(v) if isinstance(v, torch.Tensor) else v for name, v in batch.items()}


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu" or tensor.is_pinned():  # (a transform may have put it on the GPU)
        return tensor
    array = tensor_as_numpy(tensor)
    return tensor.pin_memory() if array is None else pinned_copy(array)


def pinned_copy(array: np.ndarray) -> torch.Tensor:
    """A page-locked CPU tensor holding a copy of ``array`` (same shape and dtype), made by numpy on
    this thread. Its memory comes from torch's caching host allocator, so a non-blocking copy from
    it records its stream and the memory is not reused before that copy is done (wrapped numpy
    memory would not be tracked)."""
    out = torch.empty(array.shape, dtype=_torch_dtype(array.dtype), pin_memory=True)
    np.copyto(out.numpy(), array)
    return out


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of numpy ``dtype``, as ``torch.from_numpy`` maps it (torch has no public map),
    so a column pinned has the dtype it has unpinned."""
    return torch.from_numpy(np.empty(0, dtype)).dtype


def pinning_available() -> bool:
    """Page-locked memory needs an accelerator; without one ``pin_memory`` is skipped with a warning."""
    if torch.cuda.is_available():
        return True
    log.warning("loader.pin_memory is set but no CUDA device is available: batches are not pinned")
    return False


def to_device(batches: Iterator[dict[str, Any]], device: torch.device) -> Generator[dict[str, Any], None, None]:
    """``batches`` with their tensors moved to ``device``, one batch copied ahead on CUDA."""
    if device.type != "cuda":
        for batch in batches:
            yield _move(batch, device)
        return
    stream = torch.cuda.Stream(device)
    ahead = _copy_on(stream, next(batches, None), device)
    while ahead is not None:
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        for value in ahead.values():
            if isinstance(value, torch.Tensor):
                value.record_stream(current)
        ready, ahead = ahead, _copy_on(stream, next(batches, None), device)
        yield ready


def _copy_on(stream: Any, batch: dict[str, Any] | None, device: torch.device) -> dict[str, Any] | None:
    if batch is None:
        return None
    with torch.cuda.stream(stream):
        return _move(batch, device)


def _move(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        name: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for name, v in batch.items()
    }
