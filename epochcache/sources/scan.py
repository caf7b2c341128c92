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
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from epochcache.errors import SourceError
from epochcache.sources.base import RemoteObject
from epochcache.sources.remote import RemoteFiles, credentials_error, etag_of, refused
from epochcache.sources.retry import describe

log = logging.getLogger(__name__)

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
    """ListObjectsV2 under the URL's prefix, up to ``page_size`` keys a page, in the store's order.

    Each page is asked for with the last one's continuation token; a truncated page without one
    (some S3-compatible stores leave it out) is continued after its last key (``StartAfter``), and
    then keys not after it are dropped. A store whose listing stops advancing (a page truncated
    with nothing to continue from, a token answered with itself) is a :class:`SourceError`, never
    an endless listing."""
    bucket, _, key = remote.root.partition("/")
    request: dict[str, Any] = {"Bucket": bucket, "Prefix": key.rstrip("/") + "/" if key else "", "MaxKeys": page_size}
    for number in itertools.count(1):
        reply = remote.fs.call_s3("list_objects_v2", **request)
        after = request.get("StartAfter")
        entries = [e for e in reply.get("Contents", []) if after is None or e["Key"] > after]
        # A key ending in "/" is a folder marker (the S3 console makes them), never data.
        yield [RemoteObject(f"{bucket}/{e['Key']}", int(e["Size"]), etag_of(e))
               for e in entries if not e["Key"].endswith("/")]
        if not reply.get("IsTruncated"):
            return
        token = reply.get("NextContinuationToken")
        if token and token != request.get("ContinuationToken"):
            request.pop("StartAfter", None)
            request["ContinuationToken"] = token
        elif entries and not token:
            if after is None:
                log.warning("%s: the store ends a truncated listing page without a continuation token; "
                            "listing on after each page's last key", remote.url)
            request.pop("ContinuationToken", None)
            request["StartAfter"] = max(e["Key"] for e in entries)
        else:
            why = "the continuation token it was asked with" if token else "no new key and no continuation token"
            raise SourceError(
                f"cannot list {remote.url}: page {number} of the listing is truncated but gives {why}, so the "
                "listing does not advance: the store's ListObjectsV2 is not S3-compatible (check source.url and "
                "the endpoint in source.storage_options)"
            )
