"""epochcache: train PyTorch on a remote dataset far larger than the local disk.

A sync daemon samples the remote into a rotating, budgeted cache of Arrow shards; an
EpochCachedLoader rebuilds the Dataset and DataLoader each epoch from the shards present then.
"""

import importlib
from typing import Any

from epochcache.cache.ledger import Ledger, ShardRecord
from epochcache.cache.quarantine import quarantine_shard
from epochcache.cache.repair import Repairs
from epochcache.config import (
    CacheConfig,
    Config,
    LoaderConfig,
    SamplerConfig,
    SourceConfig,
    load_config,
)
from epochcache.errors import (
    BudgetError,
    CacheEmptyError,
    CacheError,
    ConfigError,
    CorruptObjectError,
    DaemonRunningError,
    DatasetMismatchError,
    EpochcacheError,
    FetchFailedError,
    LedgerError,
    LedgerFullError,
    LoaderError,
    ObjectDeniedError,
    ObjectMissingError,
    OversizeUnitError,
    ShardCorruptError,
    SourceError,
)
from epochcache.tools.maintenance import collect_garbage, verify_cache

__version__ = "0.1.0"

# The training-side names import torch, the daemon's the remote formats (fsspec, s3fs): each side
# starts without the other's.
_LAZY = {
    "SyncDaemon": "epochcache.sync.daemon",
    "SyncReport": "epochcache.sync.report",
    "EpochCachedLoader": "epochcache.train.loader",
    "EpochInfo": "epochcache.train.epochs",
    "ShardSetDataset": "epochcache.train.dataset",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'epochcache' has no attribute {name!r}")


__all__ = [
    "BudgetError",
    "CacheConfig",
    "CacheEmptyError",
    "CacheError",
    "Config",
    "ConfigError",
    "CorruptObjectError",
    "DaemonRunningError",
    "DatasetMismatchError",
    "EpochCachedLoader",
    "EpochInfo",
    "EpochcacheError",
    "FetchFailedError",
    "Ledger",
    "LedgerError",
    "LedgerFullError",
    "LoaderConfig",
    "LoaderError",
    "ObjectDeniedError",
    "ObjectMissingError",
    "OversizeUnitError",
    "Repairs",
    "SamplerConfig",
    "ShardCorruptError",
    "ShardRecord",
    "ShardSetDataset",
    "SourceConfig",
    "SourceError",
    "SyncDaemon",
    "SyncReport",
    "collect_garbage",
    "load_config",
    "quarantine_shard",
    "verify_cache",
]
