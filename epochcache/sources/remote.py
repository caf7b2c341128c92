"""The two primitives every source builds on: list the objects under a URL, read a byte range;
and :class:`FileSource`, the part every file-format source shares (URL, columns, listing by suffix).

Errors are translated here, at the boundary: a missing object becomes :class:`ObjectMissingError`,
a refused one :class:`SourceError` naming the URL; transient failures (5xx, resets, timeouts, a body
cut short, detected by length) pass through for :mod:`epochcache.retry` to classify and retry.
Messages carry paths and causes only, never ``storage_options`` (which may hold credentials).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import fsspec
import fsspec.asyn

from epochcache.errors import ObjectMissingError, SourceError
from epochcache.retry import TruncatedReadError, describe
from epochcache.sources.base import RemoteObject


_PAGE = 1000  # objects per listing page: S3's own page size


async def _take(entries: AsyncIterator[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Up to ``count`` next items of an async iterator (fewer only at its end)."""
    taken: list[dict[str, Any]] = []
    async for entry in entries:
        taken.append(entry)
        if len(taken) == count:
            break
    return taken


class RemoteFiles:
    """An fsspec filesystem rooted at ``url``: a file, or a folder searched recursively."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if hasattr(self.fs, "retries"):  # s3fs's own retry loop: attempts are counted in epochcache.retry
            self.fs.retries = 1

    def __repr__(self) -> str:  # never show storage_options: they may hold credentials
        return f"RemoteFiles({self.url!r})"

    def scan(self, suffixes: Sequence[str], kind: str, page_size: int = _PAGE) -> Iterator[list[RemoteObject]]:
        """Objects whose names end with one of ``suffixes``, sorted by path, in pages of up to
        ``page_size``; ``kind`` names them in the error raised when there are none.

        On S3 the listing is streamed page by page (S3 lists keys in order), so a prefix of any size
        is listed in bounded memory; other filesystems are listed whole, then paged.
        """
        found = False
        try:
            if self.fs.isfile(self.root):
                pages: Iterator[list[RemoteObject]] = iter([[RemoteObject(self.root, int(self.fs.size(self.root)))]])
            elif "s3" in _protocols(self.fs):
                pages = self._s3_pages(page_size)
            else:
                pages = self._find_pages(page_size)
            for page in pages:
                matching = [obj for obj in page if obj.path.endswith(tuple(suffixes))]
                found = found or bool(matching)
                if matching:
                    yield matching
        except (FileNotFoundError, PermissionError) as exc:
            raise SourceError(f"cannot list {self.url}: {describe(exc)}") from exc
        if not found:
            raise SourceError(f"no {kind} files ({', '.join('*' + s for s in suffixes)}) under {self.url}: "
                              "check source.url")

    def _find_pages(self, page_size: int) -> Iterator[list[RemoteObject]]:
        found = self.fs.find(self.root, detail=True)
        objects = sorted((RemoteObject(path, int(info["size"])) for path, info in found.items()
                          if info.get("type", "file") == "file"), key=lambda o: o.path)
        for start in range(0, len(objects), page_size):
            yield objects[start : start + page_size]

    def _s3_pages(self, page_size: int) -> Iterator[list[RemoteObject]]:
        """s3fs's paginated ListObjectsV2 (its ``_iterdir``), ``page_size`` objects at a time."""
        bucket, _, key = self.root.partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        entries = self.fs._iterdir(bucket, delimiter="", prefix=prefix)
        try:
            while page := fsspec.asyn.sync(self.fs.loop, _take, entries, page_size):
                yield [RemoteObject(e["name"], int(e["size"])) for e in page if e.get("type") == "file"]
        finally:
            fsspec.asyn.sync(self.fs.loop, entries.aclose)

    def fetch(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` in one ranged read; exactly that many or an error."""
        try:
            data = self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError as exc:
            raise ObjectMissingError(f"{self._url(path)} is gone (deleted since it was listed?): "
                                     f"{describe(exc)}") from exc
        except PermissionError as exc:
            raise SourceError(f"cannot read {self._url(path)}: {describe(exc)}: check the credentials and "
                              "the bucket policy") from exc
        if len(data) != end - start:
            raise TruncatedReadError(f"{self._url(path)} bytes {start}-{end}: got {len(data)} bytes")
        return data

    def _url(self, path: str) -> str:
        protocol = _protocols(self.fs)[0]
        return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


class FileSource:
    """Base of the sources over files under one URL: subclasses set ``suffixes`` and ``kind`` (what the
    files are called in the error when none is found) and add the :class:`Source` protocol's ``units``
    and ``read``.

    ``columns`` None means all; an empty list is refused, since it would cache rows of nothing.
    """

    suffixes: tuple[str, ...] = ()
    kind: str = "file"
    column_word: str = "column"  # what a selectable column is called in this format

    def __init__(
        self, url: str, columns: Sequence[str] | None = None, storage_options: dict[str, Any] | None = None
    ) -> None:
        if columns is not None and not columns:
            raise SourceError(
                f"source.columns is an empty list: name at least one {self.column_word}, or null for all"
            )
        self.url = url
        self.columns = list(columns) if columns is not None else None
        self._remote = RemoteFiles(url, storage_options)

    def __repr__(self) -> str:  # never show storage_options: they may hold credentials
        return f"{type(self).__name__}({self.url!r})"

    def list_objects(self) -> list[RemoteObject]:
        return [obj for page in self.scan_objects() for obj in page]

    def scan_objects(self) -> Iterator[list[RemoteObject]]:
        return self._remote.scan(self.suffixes, self.kind)
