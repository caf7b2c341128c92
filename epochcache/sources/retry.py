"""Retries of remote reads: exponential backoff with full jitter, attempts counted where they happen.

Flow: ``Retrier.call(fn, what)`` runs ``fn``; a transient failure (:func:`is_transient`: 5xx but
501, 429, throttling by any name, timeouts, connection resets, truncated bodies, replies of another
range) is retried after a random wait in ``[0, min(backoff_max_s, backoff_s * 2**attempt)]``
(full jitter, AWS's recommendation) up to ``max_attempts`` in all, and so is a
:class:`CorruptObjectError` (a checksum mismatch may be a bit flipped in transit), re-raised as
itself after the last attempt; a permanent one (no such bucket or key, access denied, no
credentials) is raised at once.
Each retry and each give-up is counted through ``count(name)``.

Invariant: attempts are counted only here. The S3 client's own retry layers (s3fs's loop and
botocore's) are turned off by :func:`single_attempt_options`, so backoff is not multiplied by nested
loops and the counts in the ledger are the requests made, but for one kind left on: aiohttp sends a
GET once more, at once and uncounted, on a new connection when its connection closed before any reply.
HTTP lets a client do so (RFC 9112, 9.3.1): a server may close a kept-alive connection as the client
sends on it, and one that ends its keep-alive within milliseconds of a reply would otherwise fail
every request that follows another (a footer's confirming read, at each attempt).
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, TypeVar

import tenacity

from epochcache.errors import CorruptObjectError, FetchFailedError, OversizeUnitError, SourceError

log = logging.getLogger(__name__)

T = TypeVar("T")

# errnos s3fs gives transient S3 replies: SlowDown/ServiceUnavailable/503 -> EBUSY, InternalError/500
# -> EREMOTEIO; plus the socket-level ones.
_TRANSIENT_ERRNOS = {errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO), errno.ETIMEDOUT, errno.ECONNRESET,
                     errno.ECONNABORTED, errno.EPIPE}


# S3 replies another attempt may cure besides any 5xx: throttling, whatever its status and spelling
# (AWS's SlowDown, MinIO's SlowDownRead, a gateway's TooManyRequests), and timeouts of the store's own.
_THROTTLED = {"SlowDown", "SlowDownRead", "SlowDownWrite", "TooManyRequests", "Throttling", "ThrottlingException",
              "RequestLimitExceeded", "RequestThrottled", "RequestTimeout"}


class TruncatedReadError(OSError):
    """A ranged read returned fewer bytes than asked for: the body was cut short in transit."""


class RangeMismatchError(OSError):
    """A ranged read's reply holds bytes from another offset than asked (its ``Content-Range`` differs,
    or the store ignored the Range and sent the whole object): never taken for the bytes asked for;
    retried, as a proxy or cache on the way may mangle one reply."""


def is_transient(exc: BaseException) -> bool:
    """True for failures another attempt may cure; False for permanent ones (and our own errors but
    :class:`CorruptObjectError`: bytes damaged in transit read right the next time)."""
    if isinstance(exc, OversizeUnitError):  # (its size is what it is, read after read)
        return False
    if isinstance(exc, CorruptObjectError):
        return True
    if isinstance(exc, (SourceError, FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, TruncatedReadError, RangeMismatchError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return _is_transient_http(exc)


def _is_transient_http(exc: BaseException) -> bool:
    """aiohttp and botocore failures below the S3 reply level (imported lazily: optional for file://)."""
    try:
        import aiohttp
        import botocore.exceptions as bex
    except ImportError:  # no S3 stack installed: nothing of theirs can have been raised
        return False
    if isinstance(exc, (aiohttp.ClientError, bex.HTTPClientError, bex.ConnectionError)):
        return True
    # s3fs turns a reply it has no errno for (a 502 or 504 from a load balancer, a 429, MinIO's 503
    # SlowDownRead) into OSError(EIO), the store's reply kept as its cause
    error = exc.__cause__ if isinstance(exc, OSError) else exc
    if isinstance(error, bex.ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = error.response.get("Error", {}).get("Code")
        # (a 501 is the one 5xx no retry cures: the store lacks what the request asks for)
        return (status >= 500 and status != HTTPStatus.NOT_IMPLEMENTED) or status == HTTPStatus.TOO_MANY_REQUESTS \
            or code in _THROTTLED
    return False


class Retrier:
    """Calls remote reads with retries; see the module docstring."""

    def __init__(
        self,
        max_attempts: int,
        backoff_s: float,
        backoff_max_s: float,
        count: Callable[[str], None],
        stop: threading.Event | None = None,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        """``count(name)`` records one event: ``"retries"`` before each new attempt, ``"give_ups"``
        when a read fails for good. ``stop`` cuts a backoff wait short (the call then gives up).
        ``on_retry(line)``: each failed attempt that will be tried again, as one line (it may be called
        from any thread that calls :meth:`call`)."""
        self._count, self._on_retry = count, on_retry
        self._stop = stop or threading.Event()
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_attempt(max_attempts) | tenacity.stop_when_event_set(self._stop),
            wait=tenacity.wait_random_exponential(multiplier=backoff_s, max=backoff_max_s),
            sleep=self._sleep,
            before_sleep=self._before_sleep,
            reraise=True,
        )

    def call(self, fn: Callable[..., T], *args: Any, what: str) -> T:
        """``fn(*args)``, retried on transient failures. ``what`` names the read (a URL and range) in
        messages. Raises :class:`FetchFailedError` once attempts run out (the last
        :class:`CorruptObjectError` itself when that is what kept failing: the unit is then skipped
        with its reason), a permanent error at once."""
        try:
            return self._retrying(fn, *args)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._count("give_ups")
            if isinstance(exc, CorruptObjectError):
                raise
            raise FetchFailedError(f"{what}: still failing after retries: {describe(exc)}") from exc

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        self._count("retries")
        exc = state.outcome.exception() if state.outcome else None
        log.debug("attempt %d failed (%s); retrying in %.2fs", state.attempt_number,
                  describe(exc), state.upcoming_sleep)
        if self._on_retry is not None:
            self._on_retry(f"attempt {state.attempt_number} failed, retrying: {describe(exc)}")


def describe(exc: BaseException | None) -> str:
    """``Type: message`` of an exception, on one line (messages of remote errors carry no credentials)."""
    if exc is None:
        return "unknown error"
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text}"


def single_attempt_options(url: str, storage_options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``storage_options`` for ``url`` with the client's own retries off and ``timeout_s`` per request.

    Only S3 URLs are changed, and keys the user set win: a user who configured botocore retries
    keeps them (and their attempts are then not counted by us).
    """
    if not url.startswith(("s3://", "s3a://")):
        return storage_options
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    if _botocore_has("response_checksum_validation"):  # (botocore 1.36 on: before, only where asked anyway)
        # checksums are asked for by the source, for whole objects only (S3Gets._request)
        config.setdefault("response_checksum_validation", "when_required")
    config.setdefault("connect_timeout", timeout_s)
    config.setdefault("read_timeout", timeout_s)
    session_cls = _unredirected_session_cls()
    if session_cls is not None:
        config.setdefault("http_session_cls", session_cls)
    return {**storage_options, "config_kwargs": config}


@functools.cache  # (one class: the options of two sources of one store compare equal, and share a client)
def _unredirected_session_cls() -> type | None:
    """aiobotocore's aiohttp session, its requests following no redirect, as botocore's own transport
    (urllib3, ``redirect=False``) follows none: aiohttp followed a store's 3xx to its ``Location``
    with the request signed for the first endpoint, and the refusal that came back (403) read as a
    permission error. botocore then sees the 3xx itself (:func:`~epochcache.sources.s3errors.refused`).
    None where aiobotocore lacks the hooks (a session class in its config): redirects are then
    followed, as before."""
    try:
        from aiobotocore.config import AioConfig
        from aiobotocore.httpsession import AIOHTTPSession
    except ImportError:  # no S3 stack installed
        return None
    if not hasattr(AIOHTTPSession, "_get_session") or \
            "http_session_cls" not in inspect.signature(AioConfig.__init__).parameters:
        return None

    class UnredirectedSession(AIOHTTPSession):  # type: ignore[misc, valid-type]
        async def _get_session(self, proxy_url: Any) -> Any:
            return _Unredirected(await super()._get_session(proxy_url))

    return UnredirectedSession


class _Unredirected:
    """An aiohttp ``ClientSession`` seen through the one method aiobotocore calls, ``request``, with
    redirects off."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def request(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.request(*args, allow_redirects=False, **kwargs)


def _botocore_has(option: str) -> bool:
    """Whether the installed botocore's Config takes ``option`` (an unknown one is a TypeError)."""
    try:
        from botocore.config import Config
    except ImportError:  # no S3 stack installed
        return False
    return option in Config.OPTION_DEFAULTS

