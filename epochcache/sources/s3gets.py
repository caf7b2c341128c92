"""S3 GETs of one source (:class:`S3Gets`), negotiated with what the store supports, each reply
checked before its bytes are used.

Every GET is pinned by ``If-Match`` (:mod:`epochcache.sources.versions`), and its reply's version and
range are checked: a ranged reply must start where asked (its ``Content-Range``), else it is another
range's bytes. What a store is found to refuse is given up once, with one warning: a store whose
``If-Match`` refuses its own listing's spelling of an unchanged object's ETag (a HEAD shows it
unchanged) is read without ``If-Match`` from then on, pinned by the reply's ETag alone; one whose GETs
name another ETag than its listings has its listings' ETags given up; one that refuses
``x-amz-checksum-mode`` is read without it. A whole-object read is also checked against its ETag
(the body's MD5, or a multipart upload's MD5 of its parts' MD5s) or a multipart upload's composite
checksum (:mod:`epochcache.sources.digests`); botocore checks an ``x-amz-checksum-*`` the store sends
of a whole object (CRC64NVME, S3's default for new objects, and CRC32C only with awscrt installed: the
``crt`` extra; without it, a whole object whose only checks those were is read unchecked, and the
source says so once). A request is given up once silent for longer than the request timeout or
slower on average than :data:`MIN_BYTES_PER_S`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import fsspec.asyn

from epochcache.errors import CorruptObjectError
from epochcache.sources.base import RemoteObject
from epochcache.sources.digests import DigestMemory, WholeDigests, store_checked, unchecked_checksum
from epochcache.sources.retry import RangeMismatchError
from epochcache.sources.s3errors import precondition_failed, status_of
from epochcache.sources.versions import VersionPins, changed, names_listed

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # bytes of a GET body copied into a unit's image at a time
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/")
# The slowest average transfer a request may keep up (with twice sampler.request_timeout_s on top) before
# it is given up and retried; far below any link a dataset is trained over.
MIN_BYTES_PER_S = 64 * 1024


def silence_of(fs: Any) -> float | None:
    """The longest silence a request of ``fs`` may keep (botocore's read_timeout: sampler.request_timeout_s)."""
    timeout = getattr(fs, "config_kwargs", {}).get("read_timeout")
    return None if timeout is None else float(timeout)


class S3Gets:
    """The GETs of one S3 source, through ``fs`` (s3fs), pinned by ``pins``; ``url_of`` names a path in
    messages. Errors pass through raw, for :class:`~epochcache.sources.remote.RemoteFiles` to translate."""

    def __init__(self, fs: Any, pins: VersionPins, url: str, url_of: Callable[[str], str],
                 digests: DigestMemory | None = None) -> None:
        """``digests``: where the kinds of digest that matched are kept across runs (see
        :mod:`epochcache.sources.digests`)."""
        self.fs, self.pins, self.url, self._url = fs, pins, url, url_of
        self._digests = WholeDigests(digests)  # what the store's digests of whole objects are (see read)
        self._if_match = True  # until the store refuses an unchanged object's ETag (see _get_object)
        self._checksum_mode = True  # until the store refuses x-amz-checksum-mode (see _get_object)
        self._said_unchecked = False  # see read

    def read(self, obj: RemoteObject, start: int, end: int, whole: bool) -> bytes:
        """Bytes ``[start, end)`` of the listed version of ``obj`` (``whole``: the whole object, one
        byte past its listed size asked for), a whole one checked against its digests (see the module
        docstring)."""
        data, reply = self._sync(end - start, self._get, obj, start, end, whole)
        self._check_reply(obj, reply, start)
        # (asked for with ChecksumMode, which the store has not refused: botocore checked what it names)
        checked = self._unranged(obj, start, whole) and self._checksum_mode and store_checked(reply) is not None
        if whole and len(data) == obj.size and not checked:
            checked, failed = self._digests.check(data, reply)
            if failed is not None:
                # Damage in transit, or a store whose digests are not what they look like (S3-compatible
                # stores differ), or parts of sizes not guessed: a second read tells, as damage does not
                # repeat itself bit for bit.
                again, _ = self._sync(end - start, self._get, obj, start, end, whole)
                if again != data:
                    raise CorruptObjectError(f"{self._url(obj.path)}: its bytes do not match its {failed}: "
                                             "damaged in transit")
                corrupt = self._digests.agreed(failed, self._url(obj.path), self.url)
                if corrupt is not None:
                    raise CorruptObjectError(f"{self._url(obj.path)}: {corrupt}")
        if whole and not checked and not self._said_unchecked and (name := unchecked_checksum(reply)):
            self._said_unchecked = True
            log.warning("%s: its only checksum is %s: whole objects under %s like it are read unchecked",
                        self._url(obj.path), name, self.url)
        return data

    def read_into(self, obj: RemoteObject, start: int, out: memoryview) -> int:
        """Bytes ``[start, start + len(out))`` of the listed version of ``obj`` written into ``out`` as
        they arrive: how many were sent (one more than asked if the store ignored the range)."""
        got, reply = self._sync(len(out), self._get_into, obj, start, out)
        self._check_reply(obj, reply, start)
        return int(got)

    def _check_reply(self, obj: RemoteObject, reply: dict[str, Any], start: int) -> None:
        """The reply holds the listed version's bytes from ``start`` on: its version is the one pinned
        (:meth:`VersionPins.change`), and a store that ignores or mangles a Range serves bytes from
        elsewhere (its ``Content-Range``, or a whole object, says so)."""
        how = self.pins.change(obj, reply)
        if how is not None:
            raise changed(self._url(obj.path), how)
        content_range = reply.get("ContentRange")
        match = _CONTENT_RANGE.match(content_range or "")
        if content_range and (match is None or int(match.group(1)) != start):
            raise RangeMismatchError(f"{self._url(obj.path)}: asked for bytes from {start}, the store sent "
                                     f"Content-Range {content_range!r}")
        if not content_range and start > 0:
            raise RangeMismatchError(f"{self._url(obj.path)}: asked for bytes from {start}, the store ignored the "
                                     "Range and sent the whole object")

    def _request(self, obj: RemoteObject, start: int, end: int, whole: bool) -> dict[str, Any]:
        """GetObject's arguments, pinned by If-Match. A whole object pinned so is asked for without a
        Range, with ``ChecksumMode``: S3 sends (and botocore checks) its ``x-amz-checksum-*`` only for
        an unranged GET. A ranged GET asks for none: some stores send the whole object's checksum
        with a range of it, which botocore would check against the range (older MinIO and Ceph RGW),
        failing every ranged read (botocore asks only where told: ``single_attempt_options``)."""
        bucket, key, _ = self.fs.split_path(obj.path)
        request: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if not self._unranged(obj, start, whole):
            request["Range"] = f"bytes={start}-{end - 1}"
        elif self._checksum_mode:
            request["ChecksumMode"] = "ENABLED"
        pinned = self.pins.pin(obj)
        if pinned and self._if_match:
            request["IfMatch"] = pinned
        return request

    def _unranged(self, obj: RemoteObject, start: int, whole: bool) -> bool:
        """Whether the read is asked for without a Range: an empty object has no byte to range; a whole
        one pinned by If-Match cannot grow unseen."""
        return bool(whole and self.pins.listed_etag(obj)) or (start == 0 and obj.size == 0)

    def _sync(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a coroutine moving ``nbytes``) run on the filesystem's loop, cancelled once it
        takes longer than twice its silence bound (a connect and a wait for the reply may each take
        one) plus ``nbytes`` at :data:`MIN_BYTES_PER_S`: a connection that trickles bytes never falls
        silent for long, yet would hold its unit, and every unit consumed after it, for as long as it likes."""
        silence = silence_of(self.fs)
        deadline = None if silence is None else 2 * silence + nbytes / MIN_BYTES_PER_S
        return fsspec.asyn.sync(self.fs.loop, fn, *args, timeout=deadline)

    async def _get_object(self, obj: RemoteObject, request: dict[str, Any]) -> dict[str, Any]:
        """GetObject's reply to ``request``. A 412 to its If-Match on an object a HEAD shows unchanged
        (the same ETag but for quotes, ``W/`` or case, and size) means the store's If-Match refuses its
        own listing's spelling: every read would be refused. The source then reads without If-Match
        (the reply's ETag still pins each read, :meth:`_check_reply`), saying so once. One whose HEAD
        names another ETag while a listing of it still names the listed one (and size) means the
        store's GETs and listings name versions apart: its listings' ETags are given up (each object's
        reads pinned to its first reply's instead), saying so once; else the object changed."""
        try:
            return await self.fs._call_s3("get_object", **request)
        except OSError as exc:
            if "ChecksumMode" in request and status_of(exc) in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_IMPLEMENTED):
                # (asked again without: a refusal then too is this object's, and checksums stay asked for)
                reply = await self._get_object(obj, {k: v for k, v in request.items() if k != "ChecksumMode"})
                if self._checksum_mode:
                    self._checksum_mode = False
                    log.warning("%s: the store refuses to send checksums (%s to x-amz-checksum-mode): whole "
                                "objects under %s are checked by their ETag alone from now on",
                                self._url(obj.path), status_of(exc), self.url)
                return reply
            if "IfMatch" not in request or not precondition_failed(exc):
                raise
            if not await self._unchanged(obj):
                if not await self._still_listed(obj):
                    raise
                if self.pins.listing_etags:
                    self.pins.listing_etags = False
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
        return names_listed(obj, head.get("ETag"), head.get("ContentLength"))

    async def _still_listed(self, obj: RemoteObject) -> bool:
        """Whether a listing of ``obj``'s key names its listed version (ETag compared as :func:`bare_etag`,
        and size)."""
        bucket, key, _ = self.fs.split_path(obj.path)
        page = await self.fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
        entry: dict[str, Any] = next((e for e in page.get("Contents", []) if e.get("Key") == key), {})
        return names_listed(obj, entry.get("ETag"), entry.get("Size"))

    async def _get(self, obj: RemoteObject, start: int, end: int, whole: bool) -> tuple[bytes, dict[str, Any]]:
        """One GetObject (:meth:`_request`): its body and its reply."""
        reply = await self._get_object(obj, self._request(obj, start, end, whole))
        try:
            data = await reply["Body"].read()
        finally:
            reply["Body"].close()
        return data, reply

    async def _get_into(self, obj: RemoteObject, start: int, out: memoryview) -> tuple[int, dict[str, Any]]:
        """One ranged GetObject whose body is written into ``out`` as it arrives: the bytes sent (one
        past ``len(out)`` if the store sent more, having ignored the range) and the reply."""
        reply = await self._get_object(obj, self._request(obj, start, start + len(out), False))
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
