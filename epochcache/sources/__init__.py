"""Remote dataset formats behind one protocol; ``open_source`` picks one by ``source.format``.

The formats (and fsspec, s3fs and pyarrow's readers behind them) are imported when first used: the
training process needs only :data:`KEY_COLUMN` and the record types of ``base``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from epochcache.sources.base import KEY_COLUMN, RemoteObject, Source, Unit

if TYPE_CHECKING:
    from epochcache.config import SamplerConfig, SourceConfig
    from epochcache.sources.arrow import ArrowSource
    from epochcache.sources.digests import DigestMemory
    from epochcache.sources.footers import FooterStore
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


def open_source(
    config: SourceConfig, sampler: SamplerConfig | None = None, footers: FooterStore | None = None,
    digests: DigestMemory | None = None,
) -> Source:
    """Build the source that ``config.format`` names (validated by the config model), with the
    daemon's read settings from ``sampler`` (defaults if None): one attempt per request within
    ``request_timeout_s`` (retries are :mod:`epochcache.sources.retry`'s); samples over
    ``max_sample_bytes`` (a tar member, an object) refused as corrupt; Arrow IPC and Parquet objects
    up to ``whole_object_bytes`` read whole (:mod:`epochcache.sources.wholes`), a mixing window's worth
    (``mix_units`` of them) held, within ``max_inflight_bytes``; Arrow IPC and Parquet footers kept in
    ``footers`` (None: only the last few hundred, in memory); the kinds of digest that matched a
    whole object kept in ``digests`` across runs (:mod:`epochcache.sources.digests`; None: per process)."""
    from epochcache.config import SamplerConfig
    from epochcache.sources.arrow import ArrowSource
    from epochcache.sources.objects import ObjectSource
    from epochcache.sources.parquet import ParquetSource
    from epochcache.sources.retry import single_attempt_options
    from epochcache.sources.webdataset import WebDatasetSource

    sampler = sampler or SamplerConfig()
    options = single_attempt_options(config.url, config.storage_options, sampler.request_timeout_s)
    sample_bytes = int(sampler.max_sample_bytes)
    if config.format == "objects":
        return ObjectSource(config.url, columns=config.columns, storage_options=options, labels=config.labels,
                            max_sample_bytes=sample_bytes, digests=digests)
    if config.format == "webdataset":
        return WebDatasetSource(config.url, columns=config.columns, storage_options=options,
                                max_sample_bytes=sample_bytes, digests=digests)
    # Held: one mixing window of objects read whole (every unit of theirs is read within it), within
    # max_inflight_bytes: objects are read whole only up to the size at which a window fits (with
    # mix_units auto, a window may be 1024 objects).
    window = sampler.mix_units if isinstance(sampler.mix_units, int) else 1024
    whole_bytes = min(int(sampler.whole_object_bytes), int(sampler.max_inflight_bytes) // window)
    whole = {"whole_object_bytes": whole_bytes, "keep_bytes": window * whole_bytes}
    if config.format == "arrow":
        return ArrowSource(config.url, columns=config.columns, storage_options=options, footers=footers,
                           digests=digests, **whole)
    return ParquetSource(config.url, columns=config.columns, storage_options=options, footers=footers,
                         digests=digests, **whole)
