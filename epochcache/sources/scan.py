"""Listing the objects under a source URL, in pages, for the sources to cut into units.

In: a :class:`~epochcache.sources.remote.RemoteFiles` (an fsspec filesystem and the URL's root), the
file suffixes a format reads, and a page size. Out: pages of :class:`RemoteObject` (path, size, and
the etag that pins each read to the version listed), sorted by path. On S3 the listing streams page
by page (ListObjectsV2 lists keys in order), so a prefix of any size is listed in bounded memory;
other filesystems are listed whole, then paged. Errors a user can fix (a missing bucket, refused or
missing credentials, no matching file) are a :class:`SourceError` naming the URL.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import fsspec
import fsspec.asyn

from epochcache.errors import SourceError
from epochcache.sources.base import RemoteObject
from epochcache.sources.remote import RemoteFiles, credentials_error, etag_of, refused
from epochcache.sources.retry import describe

PAGE = 1000  # objects per listing page: S3's own page size


def scan(
    remote: RemoteFiles, suffixes: Sequence[str], kind: str, page_size: int = PAGE
) -> Iterator[list[RemoteObject]]:
    """Objects whose names end with one of ``suffixes``, sorted by path, in pages of up to
    ``page_size``, each with its size and etag; ``kind`` names them in the error raised when
    there are none.

    On S3 the listing is streamed page by page (S3 lists keys in order), so a prefix of any size
    is listed in bounded memory; other filesystems are listed whole, then paged.
    """
    found = False
    try:
        pages: Iterator[list[RemoteObject]]
        if remote.is_s3:
            pages = _s3_objects(remote, page_size)
        elif remote.fs.isfile(remote.root):
            pages = iter([[_one(remote, remote.fs.info(remote.root))]])
        else:
            pages = _find_pages(remote, page_size)
        for page in pages:
            matching = [obj for obj in page if obj.path.endswith(tuple(suffixes))]
            found = found or bool(matching)
            if matching:
                yield matching
    except (FileNotFoundError, PermissionError) as exc:
        raise SourceError(f"cannot list {remote.url}: {describe(exc)}: check source.url, the credentials "
                          "and the bucket policy") from exc
    except Exception as exc:
        if credentials_error(exc):
            raise SourceError(f"cannot list {remote.url}: {describe(exc)}: give credentials (AWS_* environment, "
                              "~/.aws, or source.storage_options key/secret)") from exc
        if isinstance(exc, OSError) and refused(exc):  # (a region, signature version or endpoint the store refuses)
            raise SourceError(f"cannot list {remote.url}: {describe(exc)}: check source.url and the endpoint, "
                              "region and signature settings (source.storage_options)") from exc
        raise
    if not found:
        raise SourceError(f"no {kind} files ({', '.join('*' + s for s in suffixes)}) under {remote.url}: "
                          "check source.url")

def _find_pages(remote: RemoteFiles, page_size: int) -> Iterator[list[RemoteObject]]:
    found = remote.fs.find(remote.root, detail=True)
    objects = sorted((RemoteObject(path, int(info["size"]), etag_of(info)) for path, info in found.items()
                      if info.get("type", "file") == "file"), key=lambda o: o.path)
    for start in range(0, len(objects), page_size):
        yield objects[start : start + page_size]

def _one(remote: RemoteFiles, info: dict[str, Any]) -> RemoteObject:
    return RemoteObject(remote.root, int(info["size"]), etag_of(info))

def _s3_objects(remote: RemoteFiles, page_size: int) -> Iterator[list[RemoteObject]]:
    """The prefix's pages; a URL naming one object (nothing under it as a prefix) is that object.
    Listed first: one request where a HEAD and a listing were two, and an error of the listing (a
    timeout) is raised, where ``isfile`` takes any error for "not a file"."""
    listed = False
    for page in _s3_pages(remote, page_size):
        listed = listed or bool(page)
        yield page
    if not listed:
        with contextlib.suppress(FileNotFoundError):
            info = remote.fs.info(remote.root)
            if info.get("type") == "file":
                yield [_one(remote, info)]

def _s3_pages(remote: RemoteFiles, page_size: int) -> Iterator[list[RemoteObject]]:
    """s3fs's paginated ListObjectsV2 (its ``_iterdir``), ``page_size`` objects at a time."""
    bucket, _, key = remote.root.partition("/")
    prefix = key.rstrip("/") + "/" if key else ""
    entries = remote.fs._iterdir(bucket, delimiter="", prefix=prefix)
    try:
        while page := fsspec.asyn.sync(remote.fs.loop, _take, entries, page_size):
            # A key ending in "/" is a folder marker (the S3 console makes them), never data.
            yield [RemoteObject(e["name"], int(e["size"]), etag_of(e)) for e in page
                   if e.get("type") == "file" and not e["name"].endswith("/")]
    finally:
        fsspec.asyn.sync(remote.fs.loop, entries.aclose)


async def _take(entries: AsyncIterator[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Up to ``count`` next items of an async iterator (fewer only at its end)."""
    taken: list[dict[str, Any]] = []
    async for entry in entries:
        taken.append(entry)
        if len(taken) == count:
            break
    return taken
