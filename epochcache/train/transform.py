"""User transforms, applied where batches are built (the batch thread or a DataLoader worker).

In: a batch from :class:`ShardSetDataset` (column -> tensor, list of buffers or Arrow array); out:
whatever the user's functions return. ``transform`` sees the whole batch (the fast way: vectorised
decode); ``sample_transform`` sees one sample at a time as ``{column: value}`` and the results are
collated with torch's ``default_collate``. The wrapper holds only the dataset and the two callables,
so pickling it into workers still sends paths, never data.

In the batch thread's mode a transform may run on two threads at once (the batch thread and the
trainer's, each building its own batch; see :mod:`epochcache.train.prefetch`): it must not keep
state between batches that is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset, default_collate

from epochcache.train.dataset import Batch, ShardSetDataset
from epochcache.train.jobs import Planned, then
from epochcache.train.order import EpochBatches

BatchTransform = Callable[[Batch], Any]
SampleTransform = Callable[[dict[str, Any]], Any]


class TransformedDataset(Dataset[Any]):
    """``dataset`` with ``transform`` applied per batch, or ``sample_transform`` per sample, or both
    (per sample first)."""

    def __init__(
        self,
        dataset: ShardSetDataset,
        transform: BatchTransform | None = None,
        sample_transform: SampleTransform | None = None,
    ):
        self.dataset, self._transform, self._sample_transform = dataset, transform, sample_transform

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def plain(self) -> bool:
        """Whether no transform is applied: its batches are the dataset's."""
        return self._transform is None and self._sample_transform is None

    def __getitem__(self, index: int) -> Any:
        """A batch of one: the transforms expect batches, so single samples are not unwrapped."""
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> Any:
        return self._apply(self.dataset.__getitems__(indices))

    def jobs(self, sampler: EpochBatches) -> Iterator[Planned]:
        """``sampler``'s batches as jobs that build them transformed (see :meth:`ShardSetDataset.jobs`):
        the transforms run in the job, on whichever thread runs it (two batches' at once, in the batch
        thread: :mod:`epochcache.train.prefetch`)."""
        planned = self.dataset.jobs(sampler)
        if self.plain:
            return planned
        return then(planned, self._apply)

    def _apply(self, batch: Any) -> Any:
        if self._sample_transform is not None:
            rows = len(next(iter(batch.values()), ()))  # (the indices less the rows of unreadable shards)
            batch = default_collate(
                [self._sample_transform({name: value[i] for name, value in batch.items()}) for i in range(rows)]
            )
        return batch if self._transform is None else self._transform(batch)
