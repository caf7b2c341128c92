"""Secrets kept out of every message and log line: the one redaction of the package.

``storage_options`` (and the environment) carry credentials (``key``, ``secret``, ``token``,
``aws_secret_access_key``, ``password``...). Anything that may print them goes through here:

- :func:`redact` takes a value (a mapping, a list, anything else) and returns a copy in which the value
  of every secret-named key is :data:`MASK`, at any depth;
- :func:`redact_text` takes a message and masks what follows a secret-named key written as
  ``name=value``, ``name: value``, ``'name': 'value'`` or ``name = 'value'`` (a repr, a log line,
  a config error);
- :class:`RedactingFilter` applies :func:`redact_text` to every record passing a logging handler.

Invariant: a secret-named key keeps its name (so a message still says *which* option is wrong), its
value never survives.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

# Key names whose values are secrets. "key" alone is s3fs's access key id; "...key"/"key_id" cover
# aws_secret_access_key, access_key_id, api_key; the others are matched anywhere in the name.
_SECRET_NAME = r"[A-Za-z0-9_-]*(?:secret|token|passw(?:or)?d|credential|signature|session|auth)[A-Za-z0-9_-]*" \
               r"|(?:[A-Za-z0-9_-]*[_-])?key(?:[_-]?id)?"
_IS_SECRET = re.compile(rf"(?:{_SECRET_NAME})", re.IGNORECASE)
# name, optional closing quote, ':' or '=', then a quoted string or a bare run up to a separator.
_IN_TEXT = re.compile(
    rf"""(?P<name>(?<![A-Za-z0-9_-])(?:{_SECRET_NAME}))(?P<q>['"]?)(?P<sep>\s*[:=]\s*)"""
    r"""(?P<value>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,;'"})\]]+)""",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    """Whether a key of that name holds a secret (``secret``, ``aws_session_token``, ``key``...)."""
    return _IS_SECRET.fullmatch(name) is not None


def redact(value: Any) -> Any:
    """A copy of ``value`` with every secret-named key's value replaced by :data:`MASK` (mappings and
    lists at any depth; strings are passed through :func:`redact_text`)."""
    if isinstance(value, Mapping):
        return {k: MASK if isinstance(k, str) and is_secret_name(k) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_text(text: str) -> str:
    """``text`` with the value after every secret-named key (``secret='x'``, ``"token": "y"``,
    ``password=z``) replaced by :data:`MASK`, quotes kept."""
    return _IN_TEXT.sub(_mask, text)


def _mask(match: re.Match[str]) -> str:
    value = match["value"]
    quote = value[0] if value[0] in "'\"" else ""
    return f"{match['name']}{match['q']}{match['sep']}{quote}{MASK}{quote}"


class RedactingFilter(logging.Filter):
    """A handler filter that redacts each record's final message (arguments merged in) in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_text(message)
        if record.exc_info and record.exc_info[1] is not None:
            # The traceback text is formatted later from exc_info: redact it now and drop exc_info.
            cleaned = redact_text(f"{cleaned}\n{logging.Formatter().formatException(record.exc_info)}")
            record.exc_info, record.exc_text = None, None
        if cleaned != message or record.args:
            record.msg, record.args = cleaned, None
        return True


def install_filter(logger: logging.Logger | None = None) -> RedactingFilter:
    """Put one :class:`RedactingFilter` on every handler of ``logger`` (default: the root logger);
    returns it. Idempotent: a handler that has one gets no second."""
    target = logger or logging.getLogger()
    flt = RedactingFilter()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(flt)
    return flt
