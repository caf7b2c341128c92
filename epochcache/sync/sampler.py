"""A deterministic, seekable order over every unit of the remote set, one pass at a time.

Pass ``p`` visits the objects in the permutation drawn from ``(seed, p)``. Node ``r`` of ``n`` takes
the positions ``r, r + n, r + 2n, ...`` of that permutation, so two nodes never fetch the same unit in
a pass. A node's objects are walked in *groups* of ``mix`` consecutive objects: the units of each
object are permuted by ``(seed, p, object)`` and the group's objects are interleaved round-robin, so
consecutive units (and so every shard) come from up to ``mix`` different objects, never one
contiguous slice of the remote. Only the group being walked has its metadata (Parquet footers) read,
so nothing beyond object names is listed up front; the first round asks for each object's as its
turn comes, so the group's first unit need wait only for the first object's.

Each unit appears exactly once per pass (without replacement); each pass has a fresh order, unless
``same_order`` (row slices, ``sampler.row_fraction`` < 1): then every pass walks pass 0's order, so
consecutive passes' slices line up and any stretch of one pass's length holds a slice of every unit
(a cache that straddles two fresh orders holds the union of two random subsets instead, missing up
to a quarter of the units when it spans one pass). A
:class:`Cursor` names the next position, so a restarted daemon resumes exactly where the last
published shard ended: it neither repeats nor skips units.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from epochcache.seeding import permutation
from epochcache.sources.base import RemoteObject, Unit

# Reads the units of several objects at once (their footers, concurrently); same order as given. An
# item may be read when first indexed (the sampler indexes them in order).
UnitsOf = Callable[[Sequence[RemoteObject]], Sequence[Sequence[Unit]]]


@dataclass(frozen=True)
class Cursor:
    """The next position of the order: pass, group of the node's objects, step within the group's
    interleaved unit sequence."""

    pass_: int = 0
    group: int = 0
    step: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"pass": self.pass_, "group": self.group, "step": self.step}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Cursor:
        """The cursor saved by :meth:`to_dict` (extra keys such as ``progress`` are ignored)."""
        if not data:
            return cls()
        return cls(int(data["pass"]), int(data["group"]), int(data["step"]))

    def next_pass(self) -> Cursor:
        return Cursor(pass_=self.pass_ + 1)


class Sampler:
    """Walks one pass over this node's share of ``objects`` in the order fixed by ``seed``."""

    def __init__(
        self,
        units_of: UnitsOf,
        objects: Sequence[RemoteObject],
        seed: int,
        *,
        mix: int = 8,
        node_rank: int = 0,
        num_nodes: int = 1,
        same_order: bool = False,
    ) -> None:
        self._units_of = units_of
        self._same_order = same_order
        self._objects = objects
        self._seed, self._mix = seed, mix
        self._rank, self._nodes = node_rank, num_nodes

    def node_objects(self, pass_: int) -> np.ndarray:
        """Indices into ``objects`` (int64) of this node's share of pass ``pass_``, in walk order."""
        return permutation(len(self._objects), self._seed, self._order(pass_))[self._rank :: self._nodes]

    def _order(self, pass_: int) -> int:
        """The pass whose order pass ``pass_`` walks: itself, or 0 with ``same_order``."""
        return 0 if self._same_order else pass_

    def walk(self, cursor: Cursor) -> Iterator[tuple[Unit, Cursor]]:
        """Yield ``(unit, cursor after it)`` from ``cursor`` to the end of ``cursor.pass_``."""
        mine = self.node_objects(cursor.pass_)
        for group in range(cursor.group, -(-len(mine) // self._mix)):
            members = mine[group * self._mix : (group + 1) * self._mix]
            first = cursor.step if group == cursor.group else 0
            for step, (unit, last) in enumerate(self._interleave(cursor.pass_, members)):
                if step >= first:
                    yield unit, Cursor(cursor.pass_, group + 1) if last else Cursor(cursor.pass_, group, step + 1)

    def _interleave(self, pass_: int, members: np.ndarray) -> Iterator[tuple[Unit, bool]]:
        """The units of ``members``, each object's permuted, taken round-robin across objects, each with
        whether it is the group's last. The first round asks for each object's units as its turn comes
        (``units_of`` may hand them over as they are read), so a group's first unit waits for one
        object's metadata, not for all of them: an empty cache's first shard, one remote read sooner."""
        per_object = self._units_of([self._objects[int(i)] for i in members])
        shuffled: dict[int, list[Unit]] = {}

        def units(k: int) -> list[Unit]:
            if k not in shuffled:
                got = per_object[k]
                order = permutation(len(got), self._seed, self._order(pass_), int(members[k]))
                shuffled[k] = [got[int(j)] for j in order]
            return shuffled[k]

        count, several = len(members), False  # several: an object before has a second unit
        for k in range(count):
            if units(k):  # a unit follows if one of these has a second, or a later object has any
                follows = several or len(units(k)) > 1 or any(units(i) for i in range(k + 1, count))
                yield units(k)[0], not follows
            several = several or len(units(k)) > 1
        longest = max((len(units(k)) for k in range(count)), default=0)
        rest = [units(k)[r] for r in range(1, longest) for k in range(count) if r < len(units(k))]
        for number, unit in enumerate(rest, start=1):
            yield unit, number == len(rest)
