"""Batch jobs: an epoch's batches as functions that build them, for builders on more than one thread.

In: an epoch's sequence of jobs, as :meth:`ShardSetDataset.jobs` plans them; out: batches, one per
job. A job is a callable of no arguments that builds one batch (the copy of its rows, then any
transform or pinning added with :func:`then`). Producing the sequence is the planning (locating
rows, mapping shards): it runs on one thread. The jobs themselves may run on any thread, several at
once, in any order, with one limit: :data:`FENCE` in the sequence means the jobs after it may drop
(unmap) shards that jobs before it read, so every job before a fence must be done before the
sequence is advanced past it. A reader that runs each job as it is produced (:func:`run_in_order`)
keeps that by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, Union

Job = Callable[[], Any]


class Fence:
    """The type of :data:`FENCE`."""

    def __repr__(self) -> str:
        return "FENCE"


FENCE = Fence()
Planned = Union[Job, Fence]


def then(jobs: Iterable[Planned], step: Callable[[Any], Any]) -> Iterator[Planned]:
    """``jobs`` with ``step`` applied to each one's batch, in the job (on the thread that runs it)."""
    for job in jobs:
        yield job if isinstance(job, Fence) else partial(_then, job, step)


def _then(job: Job, step: Callable[[Any], Any]) -> Any:
    return step(job())


def run_in_order(jobs: Iterable[Planned]) -> Iterator[Any]:
    """The batches of ``jobs``, each built as it is planned, on the calling thread."""
    for job in jobs:
        if not isinstance(job, Fence):
            yield job()
