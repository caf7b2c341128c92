"""S3 listing pages mended before botocore parses them (``epochcache.sources.s3listing``), page by page."""

from __future__ import annotations

from typing import Any

from epochcache.sources.s3listing import LEFT_OUT, mend_page

_ENTRY = (b"<Contents><Key>%s</Key><LastModified>%s</LastModified><ETag>&quot;%s&quot;</ETag><Size>%s</Size>"
          b"</Contents>")


def _page(*entries: bytes, truncated: bytes = b"true") -> bytes:
    return (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><IsTruncated>' + truncated
            + b"</IsTruncated>" + b"".join(entries) + b"</ListBucketResult>")


def _mended(body: bytes) -> tuple[bytes, dict[str, Any]]:
    response, custom = {"status_code": 200, "body": body}, {}
    mend_page(response_dict=response, customized_response_dict=custom)
    return response["body"], custom


def test_a_page_in_spec_is_left_as_it_was() -> None:
    body = _page(_ENTRY % (b"d/a", b"2026-11-26T16:51:01.000Z", b"0" * 32, b"12"),
                 _ENTRY % (b"d/b", b"Thu, 26 Nov 2026 16:51:01 GMT", b"1" * 32, b"0"))  # (botocore reads both)
    mended, custom = _mended(body)
    assert mended is body and custom == {}


def test_entries_botocore_cannot_read_are_taken_out_or_mended_and_named() -> None:
    good = _ENTRY % (b"d/good", b"2026-11-26T16:51:01.000Z", b"0" * 32, b"12")
    body = _page(good, _ENTRY % (b"d/a&amp;b", b"2026-11-26T16:51:01Z", b"1" * 32, b"1e3"),
                 _ENTRY % (b"d/neg", b"2026-11-26T16:51:01Z", b"2" * 32, b"-5"),
                 _ENTRY % (b"d/when", b"not-a-date", b"3" * 32, b"7"), truncated=b"1")
    mended, custom = _mended(body)
    assert custom[LEFT_OUT] == [("d/a&b", "1e3"), ("d/neg", "-5")]
    assert mended == _page(good, b"<Contents><Key>d/when</Key><ETag>&quot;" + b"3" * 32 + b"&quot;</ETag>"
                                 b"<Size>7</Size></Contents>", truncated=b"true")


def test_error_replies_are_not_touched() -> None:
    response, custom = {"status_code": 500, "body": b"<Error><Size>x</Size></Error>"}, {}
    mend_page(response_dict=response, customized_response_dict=custom)
    assert response["body"] == b"<Error><Size>x</Size></Error>" and custom == {}
