"""How a batch crosses from a DataLoader worker to the training process.

torch sends a tensor between processes by moving its storage into a new shared-memory segment and
passing the file descriptor over a socket, per tensor, per batch: for a batch of tens of large
samples that costs more than building it. A numpy array is instead pickled into the worker's result
pipe as plain bytes, which measured about twice as fast here (benchmarks/loader.py). So workers send
CPU tensors as numpy arrays (``to_wire``, the DataLoader's ``collate_fn``, a zero-copy
``Tensor.numpy()``), marked as tensors, and the trainer wraps them back (``from_wire``,
``torch.from_numpy``, no copy). Everything else arrives as it was made, as in the batch thread: a
numpy array stays an array, and a tensor numpy cannot hold (bfloat16, one that requires grad) goes
through torch's own pickling; a batch that is not a dict passes through whole. This is the generic
path: batches that fit the slots go through shared memory instead (:mod:`epochcache.train.slots`,
1.5-2x faster in benchmarks/loader.py), and only their other columns come here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch


class _Tensor(NamedTuple):
    """A CPU tensor on its way through the pipe: its numpy view."""

    array: np.ndarray


def tensor_as_numpy(value: Any) -> np.ndarray | None:
    """A CPU tensor as a numpy view (no copy), or None for anything else: not a tensor, on another
    device, requiring grad, or of a dtype numpy lacks (bfloat16, the float8 ones)."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.requires_grad:
        return None
    if value.dtype == torch.bfloat16:
        return None
    try:
        return value.numpy()
    except TypeError:  # another dtype numpy lacks
        return None


def to_wire(batch: Any) -> Any:
    """In the worker: the CPU tensors of a dict batch as marked numpy views."""
    if not isinstance(batch, dict):
        return batch
    return {k: _wire(v) for k, v in batch.items()}


def _wire(value: Any) -> Any:
    array = tensor_as_numpy(value)
    return value if array is None else _Tensor(array)


def from_wire(batch: Any) -> Any:
    """In the trainer: the tensors of a dict batch back, sharing the received arrays' memory."""
    if not isinstance(batch, dict):
        return batch
    return {k: torch.from_numpy(v.array) if isinstance(v, _Tensor) else v for k, v in batch.items()}
