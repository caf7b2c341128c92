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
from epochcache.sources.remote import RemoteFiles
from epochcache.sources.retry import describe
from epochcache.sources.s3errors import credentials_error, refused
from epochcache.sources.s3listing import LEFT_OUT, mend_listings
from epochcache.sources.versions import etag_of

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
            pages = iter([_one(remote, remote.fs.info(remote.root))])
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
    objects = sorted(_objects(remote, [(path, info.get("size"), etag_of(info)) for path, info in found.items()
                                       if info.get("type", "file") == "file"]), key=lambda o: o.path)
    for start in range(0, len(objects), page_size):
        yield objects[start : start + page_size]

def _one(remote: RemoteFiles, info: dict[str, Any]) -> list[RemoteObject]:
    return _objects(remote, [(remote.root, info.get("size"), etag_of(info))])

def _objects(remote: RemoteFiles, entries: Sequence[tuple[str, Any, str | None]]) -> list[RemoteObject]:
    """:func:`_sized`, the entries left out warned of (:func:`_left_out`)."""
    objects, bad = _sized(entries)
    _left_out(remote, bad)
    return objects

def _sized(entries: Sequence[tuple[str, Any, str | None]]) -> tuple[list[RemoteObject], list[tuple[str, Any]]]:
    """The listing's ``(path, size, etag)`` entries as objects, and ``(path, size)`` of those left out:
    their size is not a count of bytes (missing, negative, not a number: a store's bad entry, which
    no ranged read could make sense of)."""
    objects, bad = [], []
    for path, size, etag in entries:
        count = size if isinstance(size, int) and not isinstance(size, bool) else _integer(size)
        if count is None or count < 0:
            bad.append((path, size))
        else:
            objects.append(RemoteObject(path, count, etag))
    return objects, bad

def _left_out(remote: RemoteFiles, bad: Sequence[tuple[str, Any]]) -> None:
    """One warning for a page's ``(path, size as listed)`` entries left out, naming the first."""
    if bad:
        log.warning("%s: left out %d listed object(s) whose key or size is missing or bad (a size is a byte "
                    "count), e.g. %s (size %r): the store's listing is damaged (each pass lists them again)",
                    remote.url, len(bad), *bad[0])

def _integer(value: Any) -> int | None:
    """``value`` as an integer where it is one written out (``"123"``); None otherwise."""
    try:
        return int(value) if isinstance(value, str) else None
    except ValueError:
        return None

def _listing_page(remote: RemoteFiles, method: str, request: dict[str, Any], number: int) -> dict[str, Any]:
    """One listing page, parsed; a page botocore cannot parse even once mended (a shape no store
    should send) is a :class:`SourceError` naming it, not a traceback."""
    try:
        reply: dict[str, Any] = remote.fs.call_s3(method, **request)
    except (ValueError, KeyError, TypeError) as exc:  # (botocore's parser, on fields it cannot read)
        raise SourceError(f"cannot list {remote.url}: page {number} of the listing does not parse "
                          f"({describe(exc)}): the store's ListObjects is not S3-compatible (check source.url and "
                          "the endpoint in source.storage_options)") from exc
    return reply

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
                yield _one(remote, info)

def _s3_pages(remote: RemoteFiles, page_size: int) -> Iterator[list[RemoteObject]]:
    """ListObjects under the URL's prefix, ``page_size`` keys asked for a page (a page of more is cut).

    ListObjectsV2, each page asked for with the last one's continuation token. A truncated page
    without one (stores that know only ListObjects V1 answer V2 requests so) is continued by V1 from
    its last key (``Marker``, which every store honours), dropping keys not after it. S3 lists keys
    in order, so a truncated page none of whose keys comes after every key listed before it, or a
    continuation token given twice, means the listing does not advance: a :class:`SourceError`,
    never an endless listing that hands out the same objects again. Each key is listed once: one a
    page repeats, or the page before it gave (a continuation token that starts at its last key), is
    dropped; so is a key outside the prefix (a store that ignores it), with a warning. Pages a store
    wrote out of spec are mended first (:mod:`epochcache.sources.s3listing`)."""
    bucket, _, key = remote.root.partition("/")
    prefix = key.rstrip("/") + "/" if key else ""
    method = "list_objects_v2"
    request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": page_size}
    tokens: set[str] = set()
    last = ""  # the greatest key listed so far
    before: set[str] = set()  # the keys of the page before
    mend_listings(remote.fs)
    for number in itertools.count(1):
        reply = _listing_page(remote, method, request, number)
        listed = reply.get("Contents", [])  # as the store gave them: every key advances the listing
        fresh = [e for e in listed if method == "list_objects_v2" or e["Key"] > last]
        truncated = bool(reply.get("IsTruncated"))
        token = reply.get("NextContinuationToken") if method == "list_objects_v2" else None
        stalled = bool(listed) and max(e["Key"] for e in listed) <= last
        if truncated and (stalled or token in tokens or not (token or fresh)):
            why = ("no key after those listed before it" if stalled
                   else "a continuation token it gave before" if token else "no key and no continuation token")
            raise SourceError(
                f"cannot list {remote.url}: page {number} of the listing is truncated but gives {why}, so the "
                "listing does not advance: the store's ListObjects is not S3-compatible (check source.url and "
                "the endpoint in source.storage_options)"
            )
        last = max([last, *(e["Key"] for e in fresh)])
        entries = [e for e in fresh if e["Key"].startswith(prefix)]
        if len(entries) < len(fresh):
            outside = next(e["Key"] for e in fresh if not e["Key"].startswith(prefix))
            log.warning("%s: the store lists %d key(s) outside the prefix %r, e.g. %r: left out (it ignores the "
                        "listing's prefix)", remote.url, len(fresh) - len(entries), prefix, outside)
        page: dict[str, dict[str, Any]] = {}
        for entry in entries:  # each key once, as first listed
            if entry["Key"] not in before:
                page.setdefault(entry["Key"], entry)
        before = {e["Key"] for e in fresh}
        # A key ending in "/" is a folder marker (the S3 console makes them), never data.
        objects, bad = _sized([(f"{bucket}/{name}", e.get("Size"), etag_of(e))
                               for name, e in page.items() if not name.endswith("/")])
        # (the sizes as sent, where the page was mended: botocore's entry has none)
        _left_out(remote, [(f"{bucket}/{name}", size) for name, size in reply.get(LEFT_OUT, [])] or bad)
        for start in range(0, len(objects), page_size):
            yield objects[start:start + page_size]
        if not truncated:
            return
        if token:
            tokens.add(token)
            request["ContinuationToken"] = token
        else:
            if method == "list_objects_v2":
                log.warning("%s: the store ends a truncated listing page without a continuation token; "
                            "listing on with ListObjects V1 after each page's last key", remote.url)
                method = "list_objects"
                request.pop("ContinuationToken", None)
            request["Marker"] = last
