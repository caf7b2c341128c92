"""The protocol every remote format implements, and the unit of work it hands out."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

KEY_COLUMN = "__key__"


@dataclass(frozen=True)
class RemoteObject:
    """One object of the remote listing: its path as the filesystem names it, its size, and the
    version the listing saw (``etag``: the store's ETag or version id, None where the store has
    none). Every read of the object is pinned to that version: a rewritten object is never read
    up to a stale size."""

    path: str
    size: int
    etag: str | None = None


@dataclass(frozen=True)
class Unit:
    """The smallest piece read in one go: a Parquet row group, say.

    ``obj``: the object it belongs to; ``index``: the unit's number within the object; ``rows`` and
    ``row_offset`` (the object-wide index of its first row): None where the format's metadata does not
    tell them before the unit is read (Arrow IPC); ``nbytes``: the size estimate from metadata.
    """

    obj: RemoteObject
    index: int
    rows: int | None
    row_offset: int | None
    nbytes: int
    # With ``sampler.row_fraction`` < 1: which seeded slice of the unit's rows is meant (see
    # :mod:`epochcache.sync.slicing`); None: every row.
    part: int | None = None

    @property
    def key(self) -> str:
        """Stable identity of the unit across runs and passes: ``<object path>#<index>``, and
        ``~<part>`` for a slice of its rows."""
        whole = f"{self.obj.path}#{self.index}"
        return whole if self.part is None else f"{whole}~{self.part}"


def unit_path(key: str) -> str:
    """The object path of a unit key (:attr:`Unit.key`)."""
    return key.rsplit("#", 1)[0]


class Source(Protocol):
    """A remote dataset: list its objects, split an object into units, read a unit.

    ``read`` returns the unit's rows plus a :data:`KEY_COLUMN` string column holding each row's stable
    global key ``<object path>:<row index in the object>``.
    """

    url: str

    def list_objects(self) -> list[RemoteObject]:
        """All objects of the dataset, sorted by path (the sampler's permutations rely on the order)."""
        ...

    def scan_objects(self) -> Iterator[list[RemoteObject]]:
        """The objects of :meth:`list_objects` in pages, streamed where the store allows (S3): a
        listing of any size in bounded memory."""
        ...

    def units(self, obj: RemoteObject) -> Sequence[Unit]:
        """The units of one object, in storage order; reads only metadata."""
        ...

    def read(self, unit: Unit) -> pa.Table:
        """The unit's rows with the key column appended."""
        ...


def bare_etag(etag: str) -> str:
    """An ETag as compared: without quotes or a weak ``W/`` mark, in lower case (stores differ in these)."""
    return etag.removeprefix("W/").strip('"').lower()
