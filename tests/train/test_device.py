"""Pinning batches (epochcache.train.device): what pin_batch leaves as it is. (The page-locked copies
themselves need CUDA: tests/train/test_loader.py's CUDA tests.)"""

from __future__ import annotations

import torch

from epochcache.train.device import pin_batch


def test_values_that_are_not_cpu_tensors_pass_through_pinning_untouched() -> None:
    """A tensor a transform already put on another device (here: meta, which needs no GPU) cannot be
    pinned and need not be; strings and lists are not tensors. None of them reaches CUDA."""
    off_cpu = torch.empty(4, device="meta")
    names = ["a", "b"]
    pinned = pin_batch({"x": off_cpu, "names": names})
    assert pinned["x"] is off_cpu and pinned["names"] is names
