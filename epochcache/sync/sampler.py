"""A deterministic, seekable order over every unit of the remote set, one pass at a time.

Pass ``p`` visits the objects in the permutation drawn from ``(seed, p)``. Node ``r`` of ``n`` takes
the positions ``r, r + n, r + 2n, ...`` of that permutation, so two nodes never fetch the same unit in
a pass. A node's objects are walked in *groups* of ``mix`` consecutive objects: the units of each
object are permuted by ``(seed, p, object)`` and the group's objects are interleaved round-robin, so
consecutive units (and so every shard) come from up to ``mix`` different objects, never one
contiguous slice of the remote. Only the group being walked has its metadata (Parquet footers) read,
all asked for at once and walked as they arrive, so nothing beyond object names is listed up front
and the group's first reads need only its first two footers.

Each unit appears exactly once per pass (without replacement); each pass has a fresh order, unless
``same_order`` (row slices, ``sampler.row_fraction`` < 1): then every pass walks pass 0's order, so
consecutive passes' slices line up and any stretch of one pass's length holds a slice of every unit
(a cache that straddles two fresh orders holds the union of two random subsets instead, missing up
to a quarter of the units when it spans one pass). A
:class:`Cursor` names the next position, so a restarted daemon resumes exactly where the last
published shard ended: it neither repeats nor skips units.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from epochcache.seeding import permutation
from epochcache.sources.base import RemoteObject, Unit

# Reads the units of several objects at once (their footers, concurrently); same order as given. The
# answer may be lazy: each object's units are asked for only when the walk reaches the object.
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
        """Yield ``(unit, cursor after it)`` from ``cursor`` to the end of ``cursor.pass_``.

        A group's sequence is built as it is walked, one unit ahead (to tell the group's last one):
        its first unit needs the metadata of the group's first two objects, not of all of them, so
        reads start while the rest of the group's footers arrive."""
        mine = self.node_objects(cursor.pass_)
        for group in range(cursor.group, -(-len(mine) // self._mix)):
            members = mine[group * self._mix : (group + 1) * self._mix]
            first = cursor.step if group == cursor.group else 0
            steps = enumerate(itertools.islice(self._interleave(cursor.pass_, members), first, None), first)
            held = next(steps, None)
            while held is not None:
                following = next(steps, None)
                step, unit = held
                yield unit, Cursor(cursor.pass_, group, step + 1) if following else Cursor(cursor.pass_, group + 1)
                held = following

    def _interleave(self, pass_: int, members: np.ndarray) -> Iterator[Unit]:
        """The units of ``members``, each object's permuted, taken round-robin across objects; an
        object's units are asked of ``units_of``'s answer only when the sequence reaches it."""
        per_object = self._units_of([self._objects[int(i)] for i in members])
        shuffled: dict[int, list[Unit]] = {}

        def permuted(position: int) -> list[Unit]:
            if position not in shuffled:
                units, index = per_object[position], int(members[position])
                order = permutation(len(units), self._seed, self._order(pass_), index)
                shuffled[position] = [units[int(j)] for j in order]
            return shuffled[position]

        for round_ in itertools.count():
            taken = False
            for position in range(len(members)):
                units = permuted(position)
                if round_ < len(units):
                    taken = True
                    yield units[round_]
            if not taken:
                return
