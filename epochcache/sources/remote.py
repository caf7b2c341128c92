"""Reading the bytes of listed objects: :class:`RemoteFiles`, the primitive every source reads through
(a byte range, a whole object, a range written into place), with the listing's version pinned
(:mod:`epochcache.sources.versions`; S3 GETs: :mod:`epochcache.sources.s3gets`). (Listing is
:mod:`epochcache.sources.scan`; what the file formats share, :mod:`epochcache.sources.files`.)

Errors are translated here, at the boundary: a missing object, or one changed since it was listed,
becomes :class:`ObjectMissingError` (the daemon skips it for the pass; the next pass's listing sees
its new version, as does a 416 to a range inside its listed size); one object refused (403
AccessDenied, or another 4xx or a 501 that no retry cures) :class:`ObjectDeniedError` (skipped and
reported, the pass goes on); a bucket gone mid-pass, refused credentials (an invalid, expired or
mis-signed key), missing credentials, or refusals of :data:`_DENIED_IS_FATAL` objects before any
read succeeded :class:`SourceError` naming the URL (configuration: fatal); bytes that fail a store
checksum :class:`CorruptObjectError` (retried, then the unit is skipped). Transient failures (5xx,
resets, a body cut short, detected by length, another range than asked for, a store silent for
longer than the request timeout or slower on average than
:data:`~epochcache.sources.s3gets.MIN_BYTES_PER_S`: ``TimeoutError`` naming the URL) pass through
for :mod:`epochcache.sources.retry` to classify and retry. Messages carry paths and causes only,
never ``storage_options`` (which may hold credentials).

Checks against damage in transit: whole objects by their ETag or store checksum
(:mod:`epochcache.sources.s3gets`); metadata that formats leave unguarded (footers) by reading it
twice over plain HTTP (over TLS, S3's default, the records' MACs guard it: :meth:`RemoteFiles.confirm`);
data pages by the format's own checksums (Parquet page CRCs). Ranged data reads of a format without
checksums (Arrow IPC, Parquet written without page CRCs) cannot be verified: the store offers no
checksum of a byte range.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, TypeVar, overload

import fsspec

from epochcache.errors import CorruptObjectError, ObjectDeniedError, ObjectMissingError, SourceError
from epochcache.sources.base import RemoteObject
from epochcache.sources.digests import DigestMemory
from epochcache.sources.retry import TruncatedReadError, describe
from epochcache.sources.s3errors import (
    checksum_error,
    credentials_error,
    precondition_failed,
    refused,
    reply_of,
    status_of,
)
from epochcache.sources.s3gets import MIN_BYTES_PER_S, S3Gets, silence_of
from epochcache.sources.versions import VersionPins, changed, etag_of

_T = TypeVar("_T")

# S3 error codes that refuse the credentials, the clock or the request's signing, not one object: no
# object will read (a 403, or a 400 for a region or signature version the store does not take).
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "TokenRefreshRequired", "RequestTimeTooSkewed", "AuthorizationHeaderMalformed",
                    "AuthorizationQueryParametersError", "MissingSecurityHeader"}
# Objects refused (403, or another 4xx) before any read of the source succeeded that make it a configuration error
# (a policy that lets the bucket be listed but no object read), not a few bad objects.
_DENIED_IS_FATAL = 3


def blank_image(size: int) -> mmap.mmap:
    """``size`` bytes of private anonymous memory to read a unit's bytes into (:meth:`RemoteFiles.fetch_into`):
    only the pages written are ever backed by memory (so an image of a whole file costs only the
    ranges fetched), in 2 MiB pages where the kernel offers them (1/512 of the page faults)."""
    image = mmap.mmap(-1, max(1, size), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
        image.madvise(mmap.MADV_HUGEPAGE)
    return image


class RemoteFiles:
    """An fsspec filesystem rooted at ``url``: a file, or a folder searched recursively."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 digests: DigestMemory | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if hasattr(self.fs, "retries"):  # s3fs's own retry loop: attempts are counted in epochcache.sources.retry
            self.fs.retries = 1
        protocols = _protocols(self.fs)
        self.is_s3 = "s3" in protocols
        self.local = bool({"file", "local"} & set(protocols))
        self._s3 = S3Gets(self.fs, VersionPins(), url, self._url, digests) if self.is_s3 else None
        self._read_any = False  # a read of this source succeeded: a refused object is that object's, not ours
        self._denied: set[str] = set()  # paths refused (403, or another 4xx or a 501) so far
        self._tls: bool | None = None  # S3 over https (see over_tls), known once the client is made

    def __repr__(self) -> str:  # never show storage_options: they may hold credentials
        return f"RemoteFiles({self.url!r})"

    def fetch(self, obj: RemoteObject, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the listed version of ``obj`` in one ranged read; exactly that
        many or an error (:class:`ObjectMissingError` if the object changed since it was listed)."""
        data = self._read(obj, start, end, whole=False)
        if len(data) != end - start:
            raise TruncatedReadError(f"{self._url(obj.path)} bytes {start}-{end}: got {len(data)} bytes")
        return data

    def confirm(self, obj: RemoteObject, start: int, data: bytes) -> None:
        """Check bytes no checksum guards (a Parquet or Arrow footer, which every later read of the
        object trusts) by reading them again: over plain HTTP the two reads must agree, else
        :class:`CorruptObjectError` (retried). Not re-read where nothing in transit can damage them
        unseen: local files, and replies over TLS (:meth:`over_tls`), whose records carry a MAC."""
        if self.local or self.over_tls(obj):
            return
        if self.fetch(obj, start, start + len(data)) != data:
            raise CorruptObjectError(f"{self._url(obj.path)} bytes {start}-{start + len(data)}: two reads of its "
                                     "metadata differ: damaged in transit")

    def over_tls(self, obj: RemoteObject) -> bool:
        """Whether ``obj`` is read over TLS (an S3 endpoint, or an http(s) URL, of the https scheme):
        there damage in transit fails a record's MAC and the connection, never reaching a reply.
        False where it cannot tell (other filesystems): those bytes are read twice."""
        if self.is_s3:
            if self._tls is None:  # (the client exists: a read of this source came first)
                self._tls = str(self.fs.s3.meta.endpoint_url).startswith("https://")
            return self._tls
        return obj.path.startswith("https://")

    def fetch_whole(self, obj: RemoteObject) -> bytes:
        """All bytes of the listed version of ``obj``, checked against what the store offers (its ETag,
        an ``x-amz-checksum-*``: :mod:`epochcache.sources.s3gets`); one byte past the listed size is
        asked for, so an object that grew since listing is seen (:class:`ObjectMissingError`), never cut.
        Over S3, more bytes of the very version listed (its listed ETag pinned the read) mean a listing
        that misstates the size: :class:`CorruptObjectError` (skipped with that reason, reported), as
        the next listing would only say the same."""
        data = self._read(obj, 0, obj.size + 1, whole=True)
        if len(data) > obj.size:
            if self._s3 is not None and self._s3.pins.listed_etag(obj) is not None:
                raise CorruptObjectError(f"{self._url(obj.path)}: the store serves more than the {obj.size} bytes "
                                         f"its listing gives this version (ETag {obj.etag}): its listing is wrong")
            raise changed(self._url(obj.path), f"it is now over {obj.size} bytes")
        if len(data) < obj.size:
            raise TruncatedReadError(f"{self._url(obj.path)}: got {len(data)} of {obj.size} bytes")
        return data

    def fetch_into(self, obj: RemoteObject, start: int, out: memoryview) -> None:
        """Bytes ``[start, start + len(out))`` of the listed version of ``obj`` written into ``out`` in
        one ranged read, as they arrive over S3 (no copy of the whole range is made on the way);
        exactly that many or an error, like :meth:`fetch`."""
        got = len(self._read(obj, start, start + len(out), False, out))
        if got != len(out):
            raise TruncatedReadError(f"{self._url(obj.path)} bytes {start}-{start + len(out)}: got {got} bytes")

    @overload
    def _read(self, obj: RemoteObject, start: int, end: int, whole: bool) -> bytes: ...
    @overload
    def _read(self, obj: RemoteObject, start: int, end: int, whole: bool, into: memoryview) -> memoryview: ...

    def _read(
        self, obj: RemoteObject, start: int, end: int, whole: bool, into: memoryview | None = None
    ) -> bytes | memoryview:
        """Every request of a source goes through here: bytes ``[start, end)`` (``whole``: the whole
        object, see :meth:`fetch_whole`), returned, or written into ``into`` (``end - start`` long)
        and the part of it filled returned; errors translated (see the module docstring)."""
        return self._guarded(obj, lambda: self._read_unguarded(obj, start, end, whole, into))

    def _read_unguarded(
        self, obj: RemoteObject, start: int, end: int, whole: bool, into: memoryview | None
    ) -> bytes | memoryview:
        if self._s3 is not None and into is not None:
            got = self._s3.read_into(obj, start, into)
            if got > len(into):
                raise TruncatedReadError(f"{self._url(obj.path)} bytes {start}-{end}: the store sent more "
                                         "than asked (it ignored the range)")
            return into[:got]
        if self._s3 is not None:
            data = self._s3.read(obj, start, end, whole)
        elif self.local:
            self._check_local(obj)
            data = bytes(self.fs.cat_file(obj.path, start=start, end=end))
            self._check_local(obj)
        else:
            data = bytes(self.fs.cat_file(obj.path, start=start, end=end))
        if into is None:
            return data
        # fsspec offers no read into a buffer here: one copy of the bytes read
        filled = into[: min(len(data), len(into))]
        filled[:] = data[: len(filled)]
        return filled if len(data) <= len(into) else data

    def _guarded(self, obj: RemoteObject, read: Callable[[], _T]) -> _T:
        """``read()``, its errors translated (see the module docstring)."""
        url = self._url(obj.path)
        try:
            result = read()
            self._read_any = True
            return result
        except FileNotFoundError as exc:
            if reply_of(exc).get("Error", {}).get("Code") == "NoSuchBucket":
                raise SourceError(f"cannot read {url}: its bucket no longer exists ({describe(exc)}): check "
                                  "source.url") from exc
            raise ObjectMissingError(f"{url} is gone (deleted since it was listed?): {describe(exc)}") from exc
        except PermissionError as exc:
            raise self._denial(obj, exc) from exc
        except TimeoutError as exc:  # fsspec's FSTimeoutError says nothing: name the URL and the bounds
            raise TimeoutError(f"{url}: request given up: silent for {silence_of(self.fs)} s, or under "
                               f"{MIN_BYTES_PER_S // 1024} KiB/s on average (sampler.request_timeout_s; "
                               f"{describe(exc)})") from exc
        except OSError as exc:
            if precondition_failed(exc):
                raise changed(url, "its ETag no longer matches") from exc
            status = status_of(exc)
            if status == HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE:  # (a store without If-Match)
                raise changed(url, "it is shorter now: the store answered 416 to a range inside it") from exc
            if refused(exc):  # this object refused for good (an SSE-C key it lacks, say)
                raise self._denial(obj, exc) from exc
            raise
        except Exception as exc:
            if credentials_error(exc):
                raise SourceError(f"cannot read {url}: {describe(exc)}: give credentials") from exc
            if checksum_error(exc):
                raise CorruptObjectError(f"{url}: the store's checksum does not match the bytes read: "
                                         f"{describe(exc)}") from exc
            raise

    def _denial(self, obj: RemoteObject, exc: OSError) -> SourceError | ObjectDeniedError:
        """What a refusal of ``obj`` means (a 403, a redirect, or another 4xx or a 501 no retry cures):
        refused credentials, or refusals before any read succeeded of :data:`_DENIED_IS_FATAL` objects,
        are configuration (:class:`SourceError`); else this one object is refused
        (:class:`ObjectDeniedError`: skipped and reported, the others read on)."""
        url = self._url(obj.path)
        self._denied.add(obj.path)
        code = reply_of(exc).get("Error", {}).get("Code")
        status = status_of(exc)
        redirect = None
        if status is not None and 300 <= status < 400:
            where = reply_of(exc).get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("location")
            redirect = (f"the store redirects it (HTTP {status}"
                        f"{f' to {where}' if where else ''}), and epochcache follows no redirect (the request is "
                        "signed for the endpoint configured): set source.storage_options' client_kwargs.endpoint_url "
                        "to the endpoint that serves it")
        if code in _BAD_CREDENTIALS or (not self._read_any and len(self._denied) >= _DENIED_IS_FATAL):
            check = redirect or ("check the credentials and the bucket policy (s3:GetObject), and the endpoint, "
                                 "region and signature settings (source.storage_options)")
            return SourceError(f"cannot read {url} ({len(self._denied)} object(s) of {self.url} refused, none "
                               f"read): {describe(exc)}: {check}")
        if isinstance(exc, PermissionError):
            fix = "grant s3:GetObject on it (its ACL, the bucket policy, its KMS key) to have it read"
        else:
            fix = redirect or f"the store refuses to serve it (HTTP {status})"
        return ObjectDeniedError(f"cannot read {url}: {describe(exc)}: this object is skipped; {fix}")

    def _check_local(self, obj: RemoteObject) -> None:
        if obj.etag is not None:
            now = etag_of(self.fs.info(obj.path))
            if now != obj.etag:
                raise changed(self._url(obj.path), f"its mtime-size went from {obj.etag} to {now}")

    def _url(self, path: str) -> str:
        protocol = _protocols(self.fs)[0]
        return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
