"""Reading the bytes of listed objects: :class:`RemoteFiles`, the primitive every source reads through
(a byte range, a whole object, a range written into place), with the listing's version pinned.
(Listing is :mod:`epochcache.sources.scan`; what the file formats share, :mod:`epochcache.sources.files`.)

Errors are translated here, at the boundary: a missing object, or one changed since it was listed,
becomes :class:`ObjectMissingError` (the daemon skips it for the pass; the next pass's listing sees
its new version, as does a 416 to a range inside its listed size); one object refused (403
AccessDenied, or another 4xx or a 501 that no retry cures) :class:`ObjectDeniedError` (skipped and
reported, the pass goes on); a bucket gone mid-pass, refused credentials (an invalid, expired or
mis-signed key), missing credentials, or refusals of :data:`_DENIED_IS_FATAL` objects before any
read succeeded :class:`SourceError` naming the URL (configuration: fatal); bytes that fail a store
checksum :class:`CorruptObjectError` (retried, then the unit is skipped). Transient failures (5xx,
resets, a body cut short, detected by length, another range than asked for, a store silent for
longer than the request timeout or slower on average than :data:`_MIN_BYTES_PER_S`: ``TimeoutError``
naming the URL) pass through for :mod:`epochcache.sources.retry` to classify and retry. Messages
carry paths and causes only, never ``storage_options`` (which may hold credentials).

Pinning (invariant: bytes of one read all come from the version the listing saw):

- S3: the listing records each object's ETag; every GET carries ``If-Match`` with it, so a rewritten
  object answers 412 instead of bytes of another version cut at the stale size. (Of an object listed
  without one, whose version is then its listing's LastModified and size, the ETag the first read of
  that listed version was served with pins the reads after it; of replies without an ETag, their
  Last-Modified, compared with the first reply's and with a listing's without ETags. A store whose
  GETs refuse an object's listed ETag while a listing still names it has its listings' ETags given
  up: each object's reads are pinned to its first reply's.) (ListObjectsV2
  names no VersionId; the ETag pins versioned buckets as well.) The reply's ETag is compared too
  (without quotes, ``W/`` or case), for stores that ignore ``If-Match``; a store whose ``If-Match``
  refuses its own listing's spelling of an unchanged object's ETag (a HEAD shows it unchanged) is
  read without ``If-Match`` from then on, pinned by the reply's ETag alone. A ranged reply must
  start where asked (its ``Content-Range``), else it is another range's bytes. A whole-object read
  is also checked against its ETag (the body's MD5, or a multipart upload's MD5 of its parts' MD5s)
  or a multipart upload's composite checksum (:mod:`epochcache.sources.digests`); botocore checks
  an ``x-amz-checksum-*`` the store sends of a whole object (CRC64NVME, S3's default for new
  objects, and CRC32C only with awscrt installed: the ``crt`` extra; without it, a whole object
  whose only checks those were is read unchecked, and the source says so once).
- Local files: the etag is ``<mtime>-<size>``; it is compared with a fresh ``stat`` before and after
  each read.
- Other filesystems: the etag is recorded when their listing has one, but reads are not pinned;
  whole-object reads still ask one byte past the listed size, so growth is seen.

Checks against damage in transit: whole objects by their ETag or store checksum (above);
metadata that formats leave unguarded (footers) by reading it twice over plain HTTP (over TLS, S3's
default, the records' MACs guard it: :meth:`RemoteFiles.confirm`); data pages by the format's own
checksums (Parquet page CRCs). Ranged data reads of a format without checksums (Arrow IPC, Parquet
written without page CRCs) cannot be verified: the store offers no checksum of a byte range.
"""

from __future__ import annotations

import logging
import mmap
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, NamedTuple, TypeVar, overload

import fsspec
import fsspec.asyn

from epochcache.errors import CorruptObjectError, ObjectDeniedError, ObjectMissingError, SourceError
from epochcache.sources.base import RemoteObject, bare_etag
from epochcache.sources.digests import WholeDigests, unchecked_checksum
from epochcache.sources.retry import RangeMismatchError, TruncatedReadError, describe, is_transient

_CHUNK = 1 << 20  # bytes of a GET body copied into a unit's image at a time
_T = TypeVar("_T")
log = logging.getLogger(__name__)

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/")
# S3 error codes that refuse the credentials, the clock or the request's signing, not one object: no
# object will read (a 403, or a 400 for a region or signature version the store does not take).
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "TokenRefreshRequired", "RequestTimeTooSkewed", "AuthorizationHeaderMalformed",
                    "AuthorizationQueryParametersError", "MissingSecurityHeader"}
# The slowest average transfer a request may keep up (with twice sampler.request_timeout_s on top) before
# it is given up and retried; far below any link a dataset is trained over.
_MIN_BYTES_PER_S = 64 * 1024
# Objects refused (403, or another 4xx) before any read of the source succeeded that make it a configuration error
# (a policy that lets the bucket be listed but no object read), not a few bad objects.
_DENIED_IS_FATAL = 3
# Listed versions whose reads are pinned to their first reply (see RemoteFiles._pin): the most recently
# read this many.
_SERVED_ETAGS = 65536
# The version of an S3 object listed without an ETag: its listing's LastModified (seconds) and size.
_MODIFIED = "modified:"


def etag_of(info: dict[str, Any]) -> str | None:
    """The version a listing entry names: its ETag where the store has one, else ``<mtime>-<size>``
    (local files), else ``modified:<LastModified>-<size>`` (an S3 listing without ETags)."""
    for name in ("ETag", "etag"):
        if info.get(name):
            return str(info[name])
    if info.get("mtime") is not None:
        return f"{info['mtime']}-{info['size']}"
    modified = _seconds(info.get("LastModified"))
    if modified is not None:  # (an fsspec info dict, or a raw ListObjectsV2 entry)
        return f"{_MODIFIED}{modified!r}-{info.get('size', info.get('Size'))}"
    return None


def _seconds(when: Any) -> float | None:
    """A listing's or a reply's LastModified (botocore parses both to datetimes) in seconds, or None."""
    timestamp = getattr(when, "timestamp", None)
    return float(timestamp()) if callable(timestamp) else None


def _listed_modified(obj: RemoteObject) -> float | None:
    """The LastModified of the listing's ``modified:`` version of ``obj``, if it has one."""
    if not obj.etag or not obj.etag.startswith(_MODIFIED):
        return None
    return float(obj.etag[len(_MODIFIED):].rsplit("-", 1)[0])


def credentials_error(exc: BaseException) -> bool:
    """True for botocore's 'no usable credentials' errors (raised raw, not as OSError, by s3fs)."""
    try:
        import botocore.exceptions as bex
    except ImportError:  # no S3 stack installed: nothing of botocore's can have been raised
        return False
    return isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError, bex.NoRegionError))


def _checksum_error(exc: BaseException) -> bool:
    """True for botocore's mismatch of an ``x-amz-checksum-*`` the store sent."""
    try:
        import botocore.exceptions as bex
    except ImportError:
        return False
    return isinstance(exc, bex.FlexibleChecksumError)


def _response(exc: BaseException) -> dict[str, Any]:
    """The S3 error reply behind ``exc`` (s3fs hands a ClientError on as the OSError's cause); {} if none."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return getattr(cause, "response", None) or {}


def refused(exc: OSError) -> bool:
    """Whether ``exc`` is a store's refusal no retry cures: a 4xx (or a 501) that is not throttling,
    or a redirect (3xx: the S3 client follows none, :func:`~epochcache.sources.retry.single_attempt_options`).
    (A 403, 404, 412 or 416 is told apart by the caller first where it means more.)"""
    status = _status(exc)
    return status is not None and (300 <= status < 500 or status == HTTPStatus.NOT_IMPLEMENTED) \
        and not is_transient(exc)


def _status(exc: BaseException) -> int | None:
    """The HTTP status of the S3 reply behind ``exc``, if there was one."""
    status = _response(exc).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _precondition_failed(exc: BaseException) -> bool:
    """True when S3 answered 412 to our If-Match."""
    response = _response(exc)
    return bool(response.get("Error", {}).get("Code") == "PreconditionFailed"
                or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)


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

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if hasattr(self.fs, "retries"):  # s3fs's own retry loop: attempts are counted in epochcache.sources.retry
            self.fs.retries = 1
        protocols = _protocols(self.fs)
        self.is_s3 = "s3" in protocols
        self.local = bool({"file", "local"} & set(protocols))
        self._digests = WholeDigests()  # what the store's digests of whole objects are (see _s3_read)
        self._if_match = True  # until the store refuses an unchanged object's ETag (see _get_object)
        self._listing_etags = True  # until its GETs name an unchanged object otherwise (see _get_object)
        self._checksum_mode = True  # until the store refuses x-amz-checksum-mode (see _get_object)
        self._served: OrderedDict[tuple[str, str | None], _Served] = OrderedDict()  # see _pin
        self._said_unchecked = False  # see _s3_read
        self._served_lock = threading.Lock()
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
        """All bytes of the listed version of ``obj``, checked against what the store offers (its
        ETag, an ``x-amz-checksum-*``: see the module docstring); one byte past the listed size is asked for, so an
        object that grew since listing is seen (:class:`ObjectMissingError`), never cut."""
        data = self._read(obj, 0, obj.size + 1, whole=True)
        if len(data) > obj.size:
            raise self._changed(obj, f"it is now over {obj.size} bytes")
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
        if self.is_s3 and into is not None:
            got, reply = self._sync(end - start, self._s3_get_into, obj, start, into)
            self._check_served(obj, reply, start)
            if got > len(into):
                raise TruncatedReadError(f"{self._url(obj.path)} bytes {start}-{end}: the store sent more "
                                         "than asked (it ignored the range)")
            return into[:got]
        if self.is_s3:
            data = self._s3_read(obj, start, end, whole)
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
            if _response(exc).get("Error", {}).get("Code") == "NoSuchBucket":
                raise SourceError(f"cannot read {url}: its bucket no longer exists ({describe(exc)}): check "
                                  "source.url") from exc
            raise ObjectMissingError(f"{url} is gone (deleted since it was listed?): {describe(exc)}") from exc
        except PermissionError as exc:
            raise self._denial(obj, exc) from exc
        except TimeoutError as exc:  # fsspec's FSTimeoutError says nothing: name the URL and the bounds
            raise TimeoutError(f"{url}: request given up: silent for {self._silence()} s, or under "
                               f"{_MIN_BYTES_PER_S // 1024} KiB/s on average (sampler.request_timeout_s; "
                               f"{describe(exc)})") from exc
        except OSError as exc:
            if _precondition_failed(exc):
                raise self._changed(obj, "its ETag no longer matches") from exc
            status = _status(exc)
            if status == HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE:  # (a store without If-Match)
                raise self._changed(obj, "it is shorter now: the store answered 416 to a range inside it") from exc
            if refused(exc):  # this object refused for good (an SSE-C key it lacks, say)
                raise self._denial(obj, exc) from exc
            raise
        except Exception as exc:
            if credentials_error(exc):
                raise SourceError(f"cannot read {url}: {describe(exc)}: give credentials") from exc
            if _checksum_error(exc):
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
        code = _response(exc).get("Error", {}).get("Code")
        status = _status(exc)
        redirect = None
        if status is not None and 300 <= status < 400:
            where = _response(exc).get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("location")
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

    def _silence(self) -> float | None:
        """The longest silence a request may keep (botocore's read_timeout: sampler.request_timeout_s)."""
        timeout = getattr(self.fs, "config_kwargs", {}).get("read_timeout")
        return None if timeout is None else float(timeout)

    def _sync(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a coroutine moving ``nbytes``) run on the filesystem's loop, cancelled once it
        takes longer than twice its silence bound (a connect and a wait for the reply may each take
        one) plus ``nbytes`` at :data:`_MIN_BYTES_PER_S`: a connection that trickles bytes never falls
        silent for long, yet would hold its unit, and every unit consumed after it, for as long as it likes."""
        silence = self._silence()
        deadline = None if silence is None else 2 * silence + nbytes / _MIN_BYTES_PER_S
        return fsspec.asyn.sync(self.fs.loop, fn, *args, timeout=deadline)

    def _s3_read(self, obj: RemoteObject, start: int, end: int, whole: bool) -> bytes:
        data, reply = self._sync(end - start, self._s3_get, obj, start, end, whole)
        self._check_served(obj, reply, start)
        checked = False
        if whole and len(data) == obj.size:
            checked, failed = self._digests.check(data, reply)
            if failed is not None:
                # Damage in transit, or a store whose digests are not what they look like (S3-compatible
                # stores differ), or parts of sizes not guessed: a second read tells, as damage does not
                # repeat itself bit for bit.
                again, _ = self._sync(end - start, self._s3_get, obj, start, end, whole)
                if again != data:
                    raise CorruptObjectError(f"{self._url(obj.path)}: its bytes do not match its {failed}: "
                                             "damaged in transit")
                self._digests.give_up(failed, self._url(obj.path), self.url)
        if whole and not checked and not self._said_unchecked and (name := unchecked_checksum(reply)):
            self._said_unchecked = True
            log.warning("%s: its only checksum is %s: whole objects under %s like it are read unchecked",
                        self._url(obj.path), name, self.url)
        return data

    def _check_served(self, obj: RemoteObject, reply: dict[str, Any], start: int) -> None:
        """The reply holds the listed version's bytes from ``start`` on: a store that ignores If-Match
        serves another version without a word (its reply's ETag names it), and one that ignores or
        mangles a Range serves bytes from elsewhere (its ``Content-Range``, or a whole object, says so).

        Without a listed ETag and a reply's to compare, the reply's ETag, else its Last-Modified, is
        compared with the first reply's for this listed version (so the reads of one pass are of one
        version), and a Last-Modified with the listing's, where it has one and no ETag. (Only then is
        a first reply kept: reads pinned by listed ETags keep none in memory.)"""
        served, modified = reply.get("ETag") or None, _seconds(reply.get("LastModified"))  # ("": none sent)
        listed = self._listed_etag(obj)
        if listed and served:
            if bare_etag(served) != bare_etag(listed):
                raise self._changed(obj, f"its ETag went from {listed} to {served}")
        else:
            was = _listed_modified(obj)
            # (a listing's LastModified has milliseconds, Last-Modified whole seconds)
            if not served and was is not None and modified is not None and abs(modified - was) >= 1:
                raise self._changed(obj, f"its Last-Modified went from {was:.0f} to {modified:.0f}")
            this = _Served(served, modified)
            first = self._first_served(obj, this)
            if first is not None:
                raise self._changed(obj, f"its first reply was of {first}, this one of {this}")
        content_range = reply.get("ContentRange")
        match = _CONTENT_RANGE.match(content_range or "")
        if content_range and (match is None or int(match.group(1)) != start):
            raise RangeMismatchError(f"{self._url(obj.path)}: asked for bytes from {start}, the store sent "
                                     f"Content-Range {content_range!r}")
        if not content_range and start > 0:
            raise RangeMismatchError(f"{self._url(obj.path)}: asked for bytes from {start}, the store ignored the "
                                     "Range and sent the whole object")

    def _s3_request(self, obj: RemoteObject, start: int, end: int, whole: bool) -> dict[str, Any]:
        """GetObject's arguments, pinned by If-Match. A whole object pinned so is asked for without a
        Range, with ``ChecksumMode``: S3 sends (and botocore checks) its ``x-amz-checksum-*`` only for
        an unranged GET. A ranged GET asks for none: some stores send the whole object's checksum
        with a range of it, which botocore would check against the range (older MinIO and Ceph RGW),
        failing every ranged read (botocore asks only where told: ``single_attempt_options``)."""
        bucket, key, _ = self.fs.split_path(obj.path)
        request: dict[str, Any] = {"Bucket": bucket, "Key": key}
        # (an empty object has no byte to range; a whole one pinned by If-Match cannot grow unseen)
        unranged = (whole and self._listed_etag(obj)) or (start == 0 and obj.size == 0)
        if not unranged:
            request["Range"] = f"bytes={start}-{end - 1}"
        elif self._checksum_mode:
            request["ChecksumMode"] = "ENABLED"
        pinned = self._pin(obj)
        if pinned and self._if_match:
            request["IfMatch"] = pinned
        return request

    def _pin(self, obj: RemoteObject) -> str | None:
        """The ETag reads of ``obj`` are pinned to (by If-Match): the listing's, or for an object listed
        without one, the one its first read of this listed version was served with (so a footer and the
        units read after it are of one version: an object rewritten since is changed, as with a listed
        ETag); None if neither is known."""
        listed = self._listed_etag(obj)
        if listed is not None:
            return listed
        with self._served_lock:
            first = self._served.get((obj.path, obj.etag))
            return first.etag if first is not None else None

    def _listed_etag(self, obj: RemoteObject) -> str | None:
        """The store's ETag the listing gave ``obj``: None for none, for a ``modified:`` version, or
        once the store's GETs showed that its listing's ETags are not theirs (see :meth:`_get_object`)."""
        return obj.etag if self._listing_etags and obj.etag and not obj.etag.startswith(_MODIFIED) else None

    def _first_served(self, obj: RemoteObject, served: _Served) -> _Served | None:
        """Compare ``served`` with what the first reply of this listed version of ``obj`` showed (kept
        from it on, filled in by later replies: an ETag after replies without one): None if they
        agree (or this is the first), else the first's."""
        key = (obj.path, obj.etag)
        with self._served_lock:
            first = self._served.setdefault(key, served)
            self._served.move_to_end(key)
            if len(self._served) > _SERVED_ETAGS:
                self._served.popitem(last=False)
            if not first.same(served.etag, served.modified):
                return first
            self._served[key] = first.merged(served)
            return None

    async def _get_object(self, obj: RemoteObject, request: dict[str, Any]) -> dict[str, Any]:
        """GetObject's reply to ``request``. A 412 to its If-Match on an object a HEAD shows unchanged
        (the same ETag but for quotes, ``W/`` or case, and size) means the store's If-Match refuses its
        own listing's spelling: every read would be refused. The source then reads without If-Match
        (the reply's ETag still pins each read, :meth:`_check_served`), saying so once. One whose HEAD
        names another ETag while a listing of it still names the listed one (and size) means the
        store's GETs and listings name versions apart: its listings' ETags are given up (each object's
        reads pinned to its first reply's instead), saying so once; else the object changed."""
        try:
            return await self.fs._call_s3("get_object", **request)
        except OSError as exc:
            if "ChecksumMode" in request and _status(exc) in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_IMPLEMENTED):
                # (asked again without: a refusal then too is this object's, and checksums stay asked for)
                reply = await self._get_object(obj, {k: v for k, v in request.items() if k != "ChecksumMode"})
                if self._checksum_mode:
                    self._checksum_mode = False
                    log.warning("%s: the store refuses to send checksums (%s to x-amz-checksum-mode): whole "
                                "objects under %s are checked by their ETag alone from now on",
                                self._url(obj.path), _status(exc), self.url)
                return reply
            if "IfMatch" not in request or not _precondition_failed(exc):
                raise
            if not await self._unchanged(obj):
                if not await self._still_listed(obj):
                    raise
                if self._listing_etags:
                    self._listing_etags = False
                    log.warning("%s: the store's GETs refuse its listing's ETag %s, and a listing still names it: "
                                "its listings and GETs name versions apart, so reads under %s are pinned to the "
                                "ETag of each object's first reply from now on", self._url(obj.path), obj.etag,
                                self.url)
                return await self._get_object(obj, {k: v for k, v in request.items() if k != "IfMatch"})
        if self._if_match:
            self._if_match = False
            log.warning("%s: the store refuses If-Match %s though a HEAD shows the object unchanged: reads under %s "
                        "are pinned by the reply's ETag alone from now on", self._url(obj.path), obj.etag, self.url)
        return await self._get_object(obj, {k: v for k, v in request.items() if k != "IfMatch"})

    async def _unchanged(self, obj: RemoteObject) -> bool:
        """Whether a HEAD of ``obj`` shows the listed version (ETag compared as :func:`bare_etag`, and size)."""
        bucket, key, _ = self.fs.split_path(obj.path)
        head = await self.fs._call_s3("head_object", Bucket=bucket, Key=key)
        return _names_listed(obj, head.get("ETag"), head.get("ContentLength"))

    async def _still_listed(self, obj: RemoteObject) -> bool:
        """Whether a listing of ``obj``'s key names its listed version (ETag compared as :func:`bare_etag`,
        and size)."""
        bucket, key, _ = self.fs.split_path(obj.path)
        page = await self.fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
        entry: dict[str, Any] = next((e for e in page.get("Contents", []) if e.get("Key") == key), {})
        return _names_listed(obj, entry.get("ETag"), entry.get("Size"))

    async def _s3_get(self, obj: RemoteObject, start: int, end: int, whole: bool) -> tuple[bytes, dict[str, Any]]:
        """One GetObject (:meth:`_s3_request`): its body and its reply."""
        reply = await self._get_object(obj, self._s3_request(obj, start, end, whole))
        try:
            data = await reply["Body"].read()
        finally:
            reply["Body"].close()
        return data, reply

    async def _s3_get_into(self, obj: RemoteObject, start: int, out: memoryview) -> tuple[int, dict[str, Any]]:
        """One ranged GetObject whose body is written into ``out`` as it arrives: the bytes sent (one
        past ``len(out)`` if the store sent more, having ignored the range) and the reply."""
        reply = await self._get_object(obj, self._s3_request(obj, start, start + len(out), False))
        body, got = reply["Body"], 0
        try:
            while got < len(out):
                # read(n), not readinto: every aiobotocore has it (readinto came late, and copies as well)
                chunk = await body.read(min(len(out) - got, _CHUNK))
                if not chunk:
                    break
                out[got:got + len(chunk)] = chunk
                got += len(chunk)
            if got == len(out) and await body.read(1):
                got += 1
        finally:
            body.close()
        return got, reply

    def _check_local(self, obj: RemoteObject) -> None:
        if obj.etag is not None:
            now = etag_of(self.fs.info(obj.path))
            if now != obj.etag:
                raise self._changed(obj, f"its mtime-size went from {obj.etag} to {now}")

    def _changed(self, obj: RemoteObject, how: str) -> ObjectMissingError:
        return ObjectMissingError(f"{self._url(obj.path)} changed since it was listed ({how}): skipped for this "
                                  "pass; the next pass lists and reads its new version")

    def _url(self, path: str) -> str:
        protocol = _protocols(self.fs)[0]
        return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _names_listed(obj: RemoteObject, etag: str | None, size: int | None) -> bool:
    """Whether an ETag and size (a HEAD's, a listing entry's) name ``obj``'s listed version (ETags
    compared as :func:`bare_etag`)."""
    return bool(obj.etag and etag and bare_etag(etag) == bare_etag(obj.etag) and size == obj.size)


class _Served(NamedTuple):
    """What a reply shows of the version it served: its ETag (as sent: If-Match repeats it), its
    Last-Modified in seconds; either may be None (not sent)."""

    etag: str | None
    modified: float | None

    def same(self, etag: str | None, modified: float | None) -> bool:
        """Whether a reply showing ``etag`` and ``modified`` may be of this version: their ETags agree
        where both show one, else their Last-Modified where both show one (a store may stamp replies of
        one version with the time they were sent; replies without either cannot be told apart)."""
        if etag is not None and self.etag is not None:
            return bare_etag(etag) == bare_etag(self.etag)
        return modified is None or self.modified is None or modified == self.modified

    def merged(self, other: _Served) -> _Served:
        """This version, with what ``other`` (the same) shows where this shows nothing."""
        return _Served(self.etag or other.etag, self.modified if self.modified is not None else other.modified)

    def __str__(self) -> str:
        return f"ETag {self.etag}" if self.etag else f"Last-Modified {self.modified:.0f}" \
            if self.modified is not None else "unknown"


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
