"""Remote dataset formats behind one protocol; ``open_source`` picks one by ``source.format``."""

from __future__ import annotations

from epochcache.config import SourceConfig
from epochcache.sources.arrow import ArrowSource
from epochcache.sources.base import KEY_COLUMN, RemoteObject, Source, Unit
from epochcache.sources.objects import ObjectSource
from epochcache.sources.parquet import ParquetSource
from epochcache.sources.retry import single_attempt_options
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


def open_source(config: SourceConfig, request_timeout_s: float = 60.0, max_sample_bytes: int = 256 * 2**20) -> Source:
    """Build the source that ``config.format`` names (validated by the config model), making one
    attempt per request with ``request_timeout_s`` (retries are :mod:`epochcache.sources.retry`'s);
    samples over ``max_sample_bytes`` (a tar member, an object) are refused as corrupt."""
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
