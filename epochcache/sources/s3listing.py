"""S3 listing pages written out of spec, mended before botocore parses them.

In: the raw XML body of a ListObjects or ListObjectsV2 reply (botocore's ``before-parse`` event, on
the filesystem's client: :func:`mend_listings`). Out: the page botocore then parses, where

- an entry whose ``Size`` is not a byte count (negative, empty, ``abc``, ``1e3``) is taken out and
  named in the parsed reply's ``LEFT_OUT`` list (``(key, size as sent)``), for the listing to warn
  of: botocore's ``int()`` would fail the whole page (every restart again), or a negative size would
  be read with a nonsense range;
- a ``LastModified`` botocore cannot parse is taken out of its entry (it names a version only where
  the entry has no ETag), where it failed the whole page;
- an ``IsTruncated`` spelled ``True`` or ``1`` reads as true: botocore reads only ``true``, and the
  listing would end after its first page without a word.

Invariant: a page botocore parses as the store meant it is left byte for byte as it was.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from xml.sax.saxutils import unescape

log = logging.getLogger(__name__)

LEFT_OUT = "EpochcacheLeftOut"  # the key of the parsed reply's list of entries taken out

_ENTRY = re.compile(rb"<Contents>.*?</Contents>", re.S)
_KEY = re.compile(rb"<Key>(.*?)</Key>", re.S)
_SIZE = re.compile(rb"<Size>(.*?)</Size>", re.S)
_MODIFIED = re.compile(rb"<LastModified>(.*?)</LastModified>", re.S)
_TRUNCATED = re.compile(rb"(<IsTruncated>)(.*?)(</IsTruncated>)", re.S)
_COUNT = re.compile(rb"\s*[0-9]+\s*")
# S3's own spelling of a time (what botocore parses at once), and what many stores write
_ISO_TIME = re.compile(rb"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?"
                       rb"(?:Z|[+-][0-9]{2}:?[0-9]{2})")
_XML_QUOTES = {"&quot;": '"', "&apos;": "'"}


def mend_listings(fs: Any) -> None:
    """Have the S3 client of ``fs`` (an s3fs filesystem) mend its listing pages (see the module
    docstring); idempotent, and for a client the filesystem made anew too."""
    events = fs.connect().meta.events
    for operation in ("ListObjectsV2", "ListObjects"):
        events.register(f"before-parse.s3.{operation}", mend_page, unique_id=f"epochcache-mend-{operation}")


def mend_page(response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any) -> None:
    """botocore's ``before-parse`` handler: mend ``response_dict``'s body (a 200's), and name the entries
    taken out in ``customized_response_dict`` (merged into the parsed reply) under :data:`LEFT_OUT`."""
    body = response_dict.get("body")
    if response_dict.get("status_code") != 200 or not isinstance(body, bytes) or _in_spec(body):
        return
    left_out: list[tuple[str, str | None]] = []

    def entry(match: re.Match[bytes]) -> bytes:
        text = match.group(0)
        size = _SIZE.search(text)
        if size is None or not _COUNT.fullmatch(size.group(1)):
            key = _KEY.search(text)
            left_out.append((_text(key.group(1)) if key else "?", _text(size.group(1)) if size else None))
            return b""
        modified = _MODIFIED.search(text)
        if modified is not None and not _ISO_TIME.fullmatch(modified.group(1)) and not _parses(modified.group(1)):
            log.debug("listing entry %r: LastModified %r does not parse; left out of the entry", text[:200],
                      modified.group(1))
            return text[:modified.start()] + text[modified.end():]
        return text

    mended = _TRUNCATED.sub(_truthful, _ENTRY.sub(entry, body))
    if mended != body:
        response_dict["body"] = mended
    if left_out:
        customized_response_dict[LEFT_OUT] = left_out


def _in_spec(body: bytes) -> bool:
    """Whether botocore reads every field :func:`mend_page` looks at as meant: one pass per field over the
    page (a page of 1,000 entries mended entry by entry costs about 150 ms, this about 1)."""
    sizes = _SIZE.findall(body)
    return (len(sizes) == body.count(b"<Contents>") and all(map(_COUNT.fullmatch, sizes))
            and all(map(_ISO_TIME.fullmatch, _MODIFIED.findall(body)))
            and all(value in (b"true", b"false") for _, value, _ in _TRUNCATED.findall(body)))


def _truthful(match: re.Match[bytes]) -> bytes:
    value = match.group(2).strip().lower()
    spelled = b"true" if value in (b"true", b"1") else b"false" if value in (b"false", b"0") else match.group(2)
    return match.group(1) + spelled + match.group(3)


def _parses(value: bytes) -> bool:
    """Whether botocore's parser of S3 timestamps reads ``value``."""
    from botocore.utils import parse_timestamp  # (botocore is loaded by then: the reply came through it)

    try:
        parse_timestamp(_text(value))
    except (ValueError, TypeError, OverflowError, RuntimeError):  # (RuntimeError: botocore's 'no timezone offset')
        return False
    return True


def _text(value: bytes) -> str:
    return unescape(value.decode("utf-8", "replace"), _XML_QUOTES)
