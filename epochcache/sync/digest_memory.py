"""The kinds of digest that matched a source's whole objects, kept in the daemon's ledger across runs.

In: the ledger and a source's URL. Out: a :class:`~epochcache.sources.digests.DigestMemory` for that
source: a restarted daemon still knows its store's ETags to be MD5s (say), so an object whose two
reads agree against its ETag is damaged at rest, whatever the objects read first in this run.
"""

from __future__ import annotations

import logging

from epochcache.cache.ledger import Ledger
from epochcache.config import SourceConfig
from epochcache.errors import LedgerError

log = logging.getLogger(__name__)


class LedgerDigests:
    """The :class:`~epochcache.sources.digests.DigestMemory` of the source ``config`` names, in ``ledger``:
    kept by its URL and endpoint (the same URL of another store is another source), forgotten with
    the ledger (``epochcache clear``). A write the ledger fails, a full disk say, is dropped with a
    warning: the kind is learnt again."""

    def __init__(self, ledger: Ledger, config: SourceConfig) -> None:
        endpoint = (config.storage_options.get("client_kwargs") or {}).get("endpoint_url")
        self._ledger, self._url = ledger, config.url if endpoint is None else f"{config.url} at {endpoint}"

    def matched(self) -> list[str]:
        return self._ledger.daemon.digests_matched(self._url)

    def remember(self, kind: str) -> None:
        # (on a read's thread, its bytes checked: a ledger that fails this write fails no read)
        try:
            self._ledger.daemon.remember_digest(self._url, kind)
        except LedgerError as exc:
            log.warning("not recorded that %s's %ss match its objects: %s", self._url, kind, exc)
