"""How a batch crosses from a DataLoader worker to the training process.

torch sends a tensor between processes by moving its storage into a new shared-memory segment and
passing the file descriptor over a socket, per tensor, per batch: for a batch of tens of large
samples that costs more than building it. A numpy array is instead pickled into the worker's result
pipe as plain bytes, which measured about twice as fast here (benchmarks/loader.py). So workers send
numpy arrays (``to_wire``, the DataLoader's ``collate_fn``, a zero-copy ``Tensor.numpy()``) and the
trainer wraps them back (``from_wire``, ``torch.from_numpy``, no copy). Values that are not CPU
tensors or arrays pass through both unchanged; a batch that is not a dict passes through whole.
This is the generic path: batches that fit the dataset's fixed shapes go through shared-memory slots
instead (:mod:`epochcache.train.slots`, 1.5-2x faster in benchmarks/loader.py), and only their other columns come here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_wire(batch: Any) -> Any:
    """In the worker: CPU tensors of a dict batch as numpy views."""
    if not isinstance(batch, dict):
        return batch
    return {k: v.numpy() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v for k, v in batch.items()}


def from_wire(batch: Any) -> Any:
    """In the trainer: numpy arrays of a dict batch as tensors sharing their memory."""
    if not isinstance(batch, dict):
        return batch
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
