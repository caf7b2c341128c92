"""S3 listing pages written out of spec, mended before botocore parses them.

In: the raw XML body of a ListObjects or ListObjectsV2 reply (botocore's ``before-parse`` event, on
the filesystem's client: :func:`mend_listings`). Out: the page botocore then parses, where

- an entry whose ``Size`` is not a byte count (negative, empty, ``abc``, ``1e3``) loses it (the
  listing leaves an entry without a size out, and warns of it) and is named in the parsed reply's
  ``LEFT_OUT`` list (``(key, size as sent)``) for that warning: botocore's ``int()`` would fail the
  whole page (every restart again), or a negative size would be read with a nonsense range; the
  entry itself stays, so a listing goes on after its key (ListObjects V1 continues from a key);
- an entry without a ``Key`` is taken out (named ``?``);
- a ``LastModified`` that is no time (empty, ``<LastModified/>``, ``0000-00-00``, an offset past a
  day) is taken out of its entry (it names a version only where the entry has no ETag), where it
  failed the whole page or a version's seconds;
- an ``IsTruncated`` spelled ``True`` or ``1`` reads as true: botocore reads only ``true``, and the
  listing would end after its first page without a word.

Invariant: a page botocore parses as the store meant it is left byte for byte as it was.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime
from typing import Any
from urllib.parse import unquote_plus
from xml.sax.saxutils import unescape

log = logging.getLogger(__name__)

LEFT_OUT = "EpochcacheLeftOut"  # the key of the parsed reply's list of entries whose size (or key) is bad

_ENTRY = re.compile(rb"<Contents>.*?</Contents>", re.S)
_KEY = re.compile(rb"<Key>(.*?)</Key>", re.S)
_SIZE = re.compile(rb"<Size>(.*?)</Size>|<Size\s*/>", re.S)
_MODIFIED = re.compile(rb"<LastModified>(.*?)</LastModified>|<LastModified\s*/>", re.S)
_TRUNCATED = re.compile(rb"(<IsTruncated>)(.*?)(</IsTruncated>)", re.S)
_COUNT = re.compile(rb"\s*[0-9]+\s*")
_S3_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})")
_XML_QUOTES = {"&quot;": '"', "&apos;": "'"}


def mend_listings(fs: Any) -> None:
    """Have the S3 client of ``fs`` (an s3fs filesystem) mend its listing pages (see the module
    docstring); idempotent, and for a client the filesystem made anew too."""
    events = fs.connect().meta.events
    for operation in ("ListObjectsV2", "ListObjects"):
        events.register(f"before-parse.s3.{operation}", mend_page, unique_id=f"epochcache-mend-{operation}")


def mend_page(response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any) -> None:
    """botocore's ``before-parse`` handler: mend ``response_dict``'s body (a 200's), and name the entries
    whose size or key is bad in ``customized_response_dict`` (merged into the parsed reply) under
    :data:`LEFT_OUT`."""
    body = response_dict.get("body")
    if response_dict.get("status_code") != 200 or not isinstance(body, bytes) or _in_spec(body):
        return
    left_out: list[tuple[str, str | None]] = []
    # (botocore asks for url-encoded keys, and decodes those it parses: these it will not see)
    encoded = b"<EncodingType>url</EncodingType>" in body

    def entry(match: re.Match[bytes]) -> bytes:
        text = match.group(0)
        key, size = _KEY.search(text), _SIZE.search(text)
        if key is None or size is None or size.group(1) is None or not _COUNT.fullmatch(size.group(1)):
            name = _text(key.group(1)) if key else "?"
            left_out.append((unquote_plus(name) if encoded else name, _text(size.group(1) or b"") if size else None))
            if key is None:
                return b""
            if size is not None:
                text = text[:size.start()] + text[size.end():]
        modified = _MODIFIED.search(text)
        if modified is not None and not _time(modified.group(1)):
            log.debug("listing entry %r: LastModified %r is no time; left out of the entry", text[:200],
                      modified.group(0))
            text = text[:modified.start()] + text[modified.end():]
        return text

    mended = _TRUNCATED.sub(_truthful, _ENTRY.sub(entry, body))
    if mended != body:
        response_dict["body"] = mended
    if left_out:
        customized_response_dict[LEFT_OUT] = left_out


def _in_spec(body: bytes) -> bool:
    """Whether botocore reads every field :func:`mend_page` looks at as meant: one pass per field over the
    page (a page of 1,000 entries mended entry by entry costs about 150 ms, this a few)."""
    entries = body.count(b"<Contents>")
    sizes = _SIZE.findall(body)
    return (len(sizes) == entries and body.count(b"<Key>") >= entries
            and all(size and _COUNT.fullmatch(size) for size in sizes)
            and all(_time(when) for when in _MODIFIED.findall(body))
            and all(value in (b"true", b"false") for _, value, _ in _TRUNCATED.findall(body)))


def _truthful(match: re.Match[bytes]) -> bytes:
    value = match.group(2).strip().lower()
    spelled = b"true" if value in (b"true", b"1") else b"false" if value in (b"false", b"0") else match.group(2)
    return match.group(1) + spelled + match.group(3)


def _time(value: bytes | None) -> bool:
    """Whether ``value`` (a LastModified as sent; None: an empty element) is a time botocore reads and
    that has seconds since the epoch: Python's ISO reader first (S3's own spelling, at once), then
    botocore's parser (other spellings, slower)."""
    if not value:
        return False
    text = _text(value).strip()
    if _S3_TIME.fullmatch(text):  # (not every ISO form Python reads: botocore refuses 2023-W01-1)
        try:
            datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
            return True
        except ValueError:
            pass
    from botocore.utils import parse_timestamp  # (botocore is loaded by then: the reply came through it)

    try:
        parse_timestamp(text).timestamp()
    except (ValueError, TypeError, OverflowError, RuntimeError):  # (RuntimeError: botocore's 'no timezone offset')
        return False
    return True


def _text(value: bytes) -> str:
    return unescape(value.decode("utf-8", "replace"), _XML_QUOTES)
