"""The exceptions epochcache raises, one small tree.

::

    EpochcacheError                 every error of ours; the CLI prints it as one line, exit code 2
    ├── ConfigError                 config.yaml, environment or flags hold a bad key or value
    ├── SourceError                 the remote cannot be listed or read (permanent: no credentials,
    │   │                           access denied, no such bucket; no retry helps)
    │   └── ObjectMissingError      a listed object is gone, or changed since it was listed: skipped
    ├── FetchFailedError            a remote read kept failing with transient errors (retried later)
    │   └── ObjectDeniedError       one listed object refuses reads (403, another 4xx, a 501): skipped
    ├── CorruptObjectError          a remote object's bytes are bad (damaged metadata or payload, a
    │   │                           checksum mismatch, a member too large): the unit is skipped, reported
    │   └── OversizeUnitError       a unit larger than the budget can hold as one shard: skipped, never retried
    ├── CacheError                  the local cache cannot do what was asked
    │   ├── BudgetError             cache.max_bytes cannot hold what it must
    │   ├── DaemonRunningError      another sync daemon already owns the cache dir
    │   ├── DatasetMismatchError    the config would write rows of another dataset into this cache
    │   ├── LedgerError             the ledger database is unreadable: ``epochcache verify --fix`` rebuilds it
    │   │   └── LedgerFullError     the ledger could not write (disk full): nothing published, back off
    │   └── ShardCorruptError       a shard file fails its checksum or Arrow structure
    └── LoaderError                 the training side cannot build an epoch
        └── CacheEmptyError         no shard appeared before the wait timed out

Each message names the bad value and says how to fix it; the original exception, where there is
one, is kept as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Iterator


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from (or while handling), outermost first; a chain is
    short, and the bound guards against a cycle."""
    seen: BaseException | None = exc
    for _ in range(20):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


class EpochcacheError(Exception):
    """Base of every error epochcache raises on purpose."""


class ConfigError(EpochcacheError):
    """A configuration key or value is invalid; the message names its dotted path."""


class SourceError(EpochcacheError):
    """The remote dataset cannot be listed or read."""


class ObjectMissingError(SourceError):
    """An object of the listing no longer exists; the daemon skips it for the rest of the pass."""


class FetchFailedError(EpochcacheError):
    """A remote read failed with transient errors on every attempt; the daemon records the unit as
    skipped and retries it at the end of the pass."""


class ObjectDeniedError(FetchFailedError):
    """One listed object answers 403 (its ACL, the bucket policy or its KMS key refuse it), or another
    4xx or a 501 no retry cures (an SSE-C object read without its key), while the credentials
    themselves are good: not retried (no attempt helps), the unit is skipped with this
    reason, read once more at the pass end, and reported; the pass goes on. Refused credentials, or
    refusals before any object read, are a :class:`SourceError` instead."""


class CorruptObjectError(EpochcacheError):
    """A remote object (or one unit of it) is unreadable or fails a checksum the format or the store
    offers. Retried like a transient error (bytes flip in transit); when every attempt fails the unit
    is skipped with this reason and the pass goes on. Never fatal to the daemon."""


class OversizeUnitError(CorruptObjectError):
    """A unit (a row group, say) holds more bytes than ``cache.max_bytes`` can hold as one shard (a
    unit is the smallest piece a shard holds). Skipped with this reason, not read again: no retry
    makes it smaller. Only a larger budget, or the remote written in smaller units, brings it in."""


class CacheError(EpochcacheError):
    """The local shard cache cannot do what was asked."""


class BudgetError(CacheError):
    """The byte budget cannot hold what it must (for example a single shard)."""


class DaemonRunningError(CacheError):
    """Another sync daemon holds the cache directory's lock."""


class DatasetMismatchError(CacheError):
    """The cache dir holds another dataset (sources, columns or schema) than the config describes."""


class LedgerError(CacheError):
    """The ledger cannot be read or written (damaged database); ``epochcache verify --fix`` rebuilds it
    from the shard files, each of which carries its own record."""


class LedgerFullError(LedgerError):
    """The ledger's database could not be written because its filesystem is full (ENOSPC). Nothing
    was published or changed; the daemon backs off and retries, as for a shard write that hits a
    full disk, and readers go on reading."""


class ShardCorruptError(CacheError):
    """A shard file does not match its recorded checksum or is not valid Arrow IPC."""


class LoaderError(EpochcacheError):
    """The training side cannot build an epoch."""


class CacheEmptyError(LoaderError):
    """The cache held no shard when an epoch had to start."""
