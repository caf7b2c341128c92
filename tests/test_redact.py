"""epochcache.redact: one redaction for every message and log line that could carry storage_options."""

from __future__ import annotations

import logging

import pytest

from epochcache.redact import MASK, RedactingFilter, install_filter, is_secret_name, redact, redact_text

SECRETS = ("AKIAEXAMPLE0001", "very-secret-0001", "session-token-0001", "hunter2")
OPTIONS = {"key": SECRETS[0], "secret": SECRETS[1], "token": SECRETS[2],
           "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "aws_secret_access_key": SECRETS[1]},
           "anon": False}


@pytest.mark.parametrize("name", ["key", "secret", "token", "password", "passwd", "aws_secret_access_key",
                                  "aws_session_token", "access_key_id", "api_key", "sas_token", "Authorization"])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["endpoint_url", "anon", "region_name", "monkey", "keys", "url", "__key__"])
def test_ordinary_names_are_kept(name: str) -> None:
    assert not is_secret_name(name)


def test_mappings_are_masked_at_any_depth_and_keep_their_keys() -> None:
    masked = redact({"storage_options": OPTIONS, "list": [{"password": SECRETS[3]}]})
    assert masked["storage_options"]["key"] == masked["storage_options"]["secret"] == MASK
    assert masked["storage_options"]["client_kwargs"] == {"endpoint_url": "http://127.0.0.1:9000",
                                                          "aws_secret_access_key": MASK}
    assert masked["storage_options"]["anon"] is False and masked["list"] == [{"password": MASK}]
    assert OPTIONS["key"] == SECRETS[0], "the input is not changed"


@pytest.mark.parametrize("text", [
    f"storage_options = {OPTIONS!r}",
    f"sources = [{{'url': 's3://b/', 'storage_options': {OPTIONS!r}}}]",
    f'{{"key": "{SECRETS[0]}", "secret": "{SECRETS[1]}", "token": "{SECRETS[2]}"}}',
    f"--set source.storage_options.secret={SECRETS[1]}: bad; password: {SECRETS[3]}, key={SECRETS[0]}",
    f"source.storage_options.token = '{SECRETS[2]}': Input should be a valid dictionary",
])
def test_text_is_masked_in_reprs_flags_and_log_lines(text: str) -> None:
    cleaned = redact_text(text)
    assert not any(secret in cleaned for secret in SECRETS), cleaned
    assert MASK in cleaned


def test_text_without_secrets_is_unchanged() -> None:
    text = "cache.max_bytes = 'lots': unknown key; valid keys here: dir, max_bytes __key__ monkey=1"
    assert redact_text(text) == text


def test_logging_filter_masks_arguments_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("epochcache.test_redact")
    caplog.handler.addFilter(RedactingFilter())
    logger.warning("opening %s with %r", "s3://b/", OPTIONS)
    try:
        raise ValueError(f"bad options {OPTIONS!r}")
    except ValueError:
        logger.exception("failed")
    text = caplog.text
    assert "s3://b/" in text and "ValueError" in text and "endpoint_url" in text
    assert not any(secret in text for secret in SECRETS), text


def test_install_filter_puts_one_filter_on_each_handler() -> None:
    logger = logging.getLogger("epochcache.test_redact.install")
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    try:
        install_filter(logger)
        install_filter(logger)
        assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
    finally:
        logger.removeHandler(handler)
