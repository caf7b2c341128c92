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
    assert mended == _page(good, b"<Contents><Key>d/a&amp;b</Key><LastModified>2026-11-26T16:51:01Z</LastModified>"
                                 b"<ETag>&quot;" + b"1" * 32 + b"&quot;</ETag></Contents>",  # kept: its key advances
                           b"<Contents><Key>d/neg</Key><LastModified>2026-11-26T16:51:01Z</LastModified><ETag>&quot;"
                           + b"2" * 32 + b"&quot;</ETag></Contents>",
                           b"<Contents><Key>d/when</Key><ETag>&quot;" + b"3" * 32 + b"&quot;</ETag>"
                           b"<Size>7</Size></Contents>", truncated=b"true")


def test_empty_or_impossible_times_and_keyless_entries_are_mended() -> None:
    entries = [_ENTRY % (b"d/zero", b"0000-00-00T00:00:00Z", b"0" * 32, b"1"),
               _ENTRY % (b"d/feb", b"2024-02-30T00:00:00Z", b"1" * 32, b"1"),
               _ENTRY % (b"d/week", b"2023-W01-1", b"2" * 32, b"1"),  # (ISO to Python, not to botocore)
               b"<Contents><Key>d/empty</Key><LastModified/><Size>1</Size></Contents>",
               b"<Contents><LastModified>2026-11-26T16:51:01Z</LastModified><Size>1</Size></Contents>"]
    mended, custom = _mended(_page(*entries))
    assert custom[LEFT_OUT] == [("?", "1")]
    assert b"LastModified" not in mended and mended.count(b"<Contents>") == 4


def test_error_replies_are_not_touched() -> None:
    response, custom = {"status_code": 500, "body": b"<Error><Size>x</Size></Error>"}, {}
    mend_page(response_dict=response, customized_response_dict=custom)
    assert response["body"] == b"<Error><Size>x</Size></Error>" and custom == {}
