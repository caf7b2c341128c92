"""Remote dataset formats behind one protocol; ``open_source`` picks one by ``source.format``."""

from __future__ import annotations

from epochcache.config import SourceConfig
from epochcache.sources.base import KEY_COLUMN, RemoteObject, Source, Unit
from epochcache.sources.parquet import ParquetSource

__all__ = ["KEY_COLUMN", "ParquetSource", "RemoteObject", "Source", "Unit", "open_source"]


def open_source(config: SourceConfig) -> Source:
    """Build the source that ``config.format`` names (validated by the config model)."""
    return ParquetSource(config.url, columns=config.columns, storage_options=config.storage_options)
