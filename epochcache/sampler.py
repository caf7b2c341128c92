"""A deterministic, seekable order over every unit of the remote set, one pass at a time.

Two levels, so nothing beyond object names is listed up front: pass ``p`` visits the objects in the
permutation drawn from ``(seed, p)``, and within object ``i`` its units in the permutation drawn from
``(seed, p, i)``. Each unit appears exactly once per pass (without replacement); each pass has a fresh
order. A :class:`Cursor` names the next position, so a restarted daemon resumes exactly where the
last published shard ended: it neither repeats nor skips units.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from epochcache.seeding import permutation
from epochcache.sources.base import RemoteObject, Source, Unit


@dataclass(frozen=True)
class Cursor:
    """The next position of the order: pass, index into the pass's object order, index into the
    current object's unit order."""

    pass_: int = 0
    obj: int = 0
    unit: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int] | None) -> Cursor:
        return cls(**data) if data else cls()

    def next_pass(self) -> Cursor:
        return Cursor(pass_=self.pass_ + 1)


class Sampler:
    """Walks one pass over ``objects`` of ``source`` in the order fixed by ``seed``."""

    def __init__(self, source: Source, objects: Sequence[RemoteObject], seed: int) -> None:
        self._source = source
        self._objects = objects
        self._seed = seed

    def walk(self, cursor: Cursor) -> Iterator[tuple[Unit, Cursor]]:
        """Yield ``(unit, cursor after it)`` from ``cursor`` to the end of ``cursor.pass_``.

        Object metadata (a Parquet footer) is read only when the walk reaches that object.
        """
        order = permutation(len(self._objects), self._seed, cursor.pass_)
        for position in range(cursor.obj, len(self._objects)):
            obj_index = int(order[position])
            units = self._source.units(self._objects[obj_index])
            unit_order = permutation(len(units), self._seed, cursor.pass_, obj_index)
            first = cursor.unit if position == cursor.obj else 0
            for j in range(first, len(units)):
                after = Cursor(cursor.pass_, position, j + 1) if j + 1 < len(units) else Cursor(cursor.pass_, position + 1)
                yield units[int(unit_order[j])], after
