"""The kinds of digest that matched a source's whole objects, kept in the daemon's ledger across runs.

In: the ledger and a source's URL. Out: a :class:`~epochcache.sources.digests.DigestMemory` for that
source: a restarted daemon still knows its store's ETags to be MD5s (say), so an object whose two
reads agree against its ETag is damaged at rest, whatever the objects read first in this run.
"""

from __future__ import annotations

from epochcache.cache.ledger import Ledger
from epochcache.sync.notes import note


class LedgerDigests:
    """The :class:`~epochcache.sources.digests.DigestMemory` of the source at ``url`` in ``ledger``
    (a write that a full disk refuses is dropped with a warning: the kind is learnt again)."""

    def __init__(self, ledger: Ledger, url: str) -> None:
        self._ledger, self._url = ledger, url

    def matched(self) -> list[str]:
        return self._ledger.daemon.digests_matched(self._url)

    def remember(self, kind: str) -> None:
        note(self._ledger.daemon.remember_digest, self._url, kind)
