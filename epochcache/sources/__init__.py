"""Remote dataset formats behind one protocol; ``open_source`` picks one by ``source.format``.

The formats (and fsspec, s3fs and pyarrow's readers behind them) are imported when first used: the
training process needs only :data:`KEY_COLUMN` and the record types of ``base``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from epochcache.sources.base import KEY_COLUMN, RemoteObject, Source, Unit

if TYPE_CHECKING:
    from epochcache.config import SourceConfig
    from epochcache.sources.arrow import ArrowSource
    from epochcache.sources.objects import ObjectSource
    from epochcache.sources.parquet import ParquetSource
    from epochcache.sources.webdataset import WebDatasetSource

__all__ = [
    "KEY_COLUMN",
    "ArrowSource",
    "ObjectSource",
    "ParquetSource",
    "RemoteObject",
    "Source",
    "Unit",
    "WebDatasetSource",
    "open_source",
]

_FORMATS = {"ArrowSource": "arrow", "ObjectSource": "objects", "ParquetSource": "parquet",
            "WebDatasetSource": "webdataset"}


def __getattr__(name: str) -> Any:
    if name in _FORMATS:
        return getattr(importlib.import_module(f"epochcache.sources.{_FORMATS[name]}"), name)
    raise AttributeError(f"module 'epochcache.sources' has no attribute {name!r}")


def open_source(config: SourceConfig, request_timeout_s: float = 60.0, max_sample_bytes: int = 256 * 2**20) -> Source:
    """Build the source that ``config.format`` names (validated by the config model), making one
    attempt per request with ``request_timeout_s`` (retries are :mod:`epochcache.sources.retry`'s);
    samples over ``max_sample_bytes`` (a tar member, an object) are refused as corrupt."""
    from epochcache.sources.arrow import ArrowSource
    from epochcache.sources.objects import ObjectSource
    from epochcache.sources.parquet import ParquetSource
    from epochcache.sources.retry import single_attempt_options
    from epochcache.sources.webdataset import WebDatasetSource

    options = single_attempt_options(config.url, config.storage_options, request_timeout_s)
    if config.format == "objects":
        return ObjectSource(config.url, columns=config.columns, storage_options=options, labels=config.labels,
                            max_sample_bytes=max_sample_bytes)
    if config.format == "arrow":
        return ArrowSource(config.url, columns=config.columns, storage_options=options)
    if config.format == "webdataset":
        return WebDatasetSource(config.url, columns=config.columns, storage_options=options,
                                max_sample_bytes=max_sample_bytes)
    return ParquetSource(config.url, columns=config.columns, storage_options=options)
