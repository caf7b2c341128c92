"""What an error of an S3 request says: a store's refusal (:func:`refused`), its HTTP status and error
reply, missing credentials, a checksum that did not match. (What another attempt may cure is
:func:`epochcache.sources.retry.is_transient`'s to say.)"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from epochcache.sources.retry import is_transient


def credentials_error(exc: BaseException) -> bool:
    """True for botocore's 'no usable credentials' errors (raised raw, not as OSError, by s3fs)."""
    try:
        import botocore.exceptions as bex
    except ImportError:  # no S3 stack installed: nothing of botocore's can have been raised
        return False
    return isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError, bex.NoRegionError))


def checksum_error(exc: BaseException) -> bool:
    """True for botocore's mismatch of an ``x-amz-checksum-*`` the store sent."""
    try:
        import botocore.exceptions as bex
    except ImportError:
        return False
    return isinstance(exc, bex.FlexibleChecksumError)


def reply_of(exc: BaseException) -> dict[str, Any]:
    """The S3 error reply behind ``exc`` (s3fs hands a ClientError on as the OSError's cause); {} if none."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return getattr(cause, "response", None) or {}


def refused(exc: OSError) -> bool:
    """Whether ``exc`` is a store's refusal no retry cures: a 4xx (or a 501) that is not throttling,
    or a redirect (3xx: the S3 client follows none, :func:`~epochcache.sources.retry.single_attempt_options`).
    (A 403, 404, 412 or 416 is told apart by the caller first where it means more.)"""
    status = status_of(exc)
    return status is not None and (300 <= status < 500 or status == HTTPStatus.NOT_IMPLEMENTED) \
        and not is_transient(exc)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of the S3 reply behind ``exc``, if there was one."""
    status = reply_of(exc).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def precondition_failed(exc: BaseException) -> bool:
    """True when S3 answered 412 to our If-Match."""
    response = reply_of(exc)
    return bool(response.get("Error", {}).get("Code") == "PreconditionFailed"
                or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)
