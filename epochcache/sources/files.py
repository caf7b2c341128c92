"""FileSource: the part every file-format source shares: its URL, its columns, its listing by suffix.

In: a source URL, the columns selected (None: all) and fsspec's storage options. Out: the objects to
read (:meth:`FileSource.scan_objects`, :func:`epochcache.sources.scan.scan` over the format's
suffixes) and the :class:`~epochcache.sources.remote.RemoteFiles` that reads their bytes; subclasses
(Parquet, Arrow IPC, WebDataset, whole objects) add the :class:`Source` protocol's ``units`` and
``read``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from epochcache.arrays import numbers, text
from epochcache.errors import SourceError
from epochcache.sources.base import KEY_COLUMN, RemoteObject
from epochcache.sources.digests import DigestMemory
from epochcache.sources.footers import FooterStore
from epochcache.sources.pool import ROWS_POOL
from epochcache.sources.remote import RemoteFiles
from epochcache.sources.scan import scan

# Parsed footers a source keeps in memory; beyond them, a source given a FooterStore reads them from disk.
FOOTERS_IN_MEMORY = 256
_Parsed = TypeVar("_Parsed")


class FileSource:
    """Base of the sources over files under one URL: subclasses set ``suffixes`` and ``kind`` (what the
    files are called in the error when none is found) and add the :class:`Source` protocol's ``units``
    and ``read``.

    ``columns`` None means all; an empty list is refused, since it would cache rows of nothing.
    ``footers``: where the formats with footers (Parquet, Arrow IPC) keep them between passes and
    runs, for objects read over S3, where every read is pinned to the listed ETag (elsewhere a
    version is not pinned, and a local file's footer costs no request).
    """

    suffixes: tuple[str, ...] = ()
    kind: str = "file"
    column_word: str = "column"  # what a selectable column is called in this format

    def __init__(
        self, url: str, columns: Sequence[str] | None = None, storage_options: dict[str, Any] | None = None,
        footers: FooterStore | None = None, digests: DigestMemory | None = None,
    ) -> None:
        if columns is not None and not columns:
            raise SourceError(
                f"source.columns is an empty list: name at least one {self.column_word}, or null for all"
            )
        self.url = url
        self.columns = list(columns) if columns is not None else None
        self._remote = RemoteFiles(url, storage_options, digests)
        self._footers = footers if self._remote.is_s3 else None
        self._parsed: Any = None  # see _footer_cache

    def __repr__(self) -> str:  # never show storage_options: they may hold credentials
        return f"{type(self).__name__}({self.url!r})"

    def list_objects(self) -> list[RemoteObject]:
        return [obj for page in self.scan_objects() for obj in page]

    @staticmethod
    def _keyed(table: pa.Table, prefix: str, first: int) -> pa.Table:
        """``table`` with :data:`KEY_COLUMN` appended: ``<prefix><first + row>`` for each row."""
        rows = numbers(np.arange(first, first + table.num_rows, dtype=np.int64))
        keys = pc.binary_join_element_wise(text(prefix), pc.cast(rows, pa.string(), memory_pool=ROWS_POOL),
                                           text(""), memory_pool=ROWS_POOL)
        return table.append_column(KEY_COLUMN, keys)

    def scan_objects(self) -> Iterator[list[RemoteObject]]:
        return scan(self._remote, self.suffixes, self.kind)

    def _footer_cache(self, read: Callable[[RemoteObject], _Parsed]) -> Callable[[RemoteObject], _Parsed]:
        """``read`` (an object's parsed footer) with its last :data:`FOOTERS_IN_MEMORY` results kept in
        memory, until :meth:`_forget_footer`."""
        self._parsed = functools.lru_cache(maxsize=FOOTERS_IN_MEMORY)(read)
        return self._parsed  # type: ignore[no-any-return]

    def _stored_footer(self, obj: RemoteObject) -> bytes | None:
        """The footer bytes kept for this version of ``obj`` by an earlier read, or None."""
        return None if self._footers is None else self._footers.get(self.kind, obj)

    def _keep_footer(self, obj: RemoteObject, footer: bytes) -> None:
        """Keep ``footer`` for this version of ``obj``: call only once it is checked (read twice, or
        found in the object's whole bytes)."""
        if self._footers is not None:
            self._footers.put(self.kind, obj, footer)

    def _forget_footer(self, obj: RemoteObject) -> None:
        """Read ``obj``'s footer afresh next time (damage is suspected): from memory and from disk."""
        if self._parsed is not None:
            self._parsed.cache_clear()
        if self._footers is not None:
            self._footers.forget(self.kind, obj)
