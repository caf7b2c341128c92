"""What the sync daemon keeps in the ledger between runs: where it is, what it listed, what it skipped.

In: the ledger's database (:class:`epochcache.cache.ledger_db.LedgerDatabase`). Out, through
:class:`DaemonState` (``Ledger.daemon``): the sampler's cursor, each source's listing (a header and
its pages of ``(path, size, etag)``), the daemon's status for ``epochcache status``, the dataset
identity the cache is bound to, and the units skipped after their reads kept failing. Each call is
one transaction; the cursor also moves inside ``Ledger.publish``, atomically with the shard it covers.
"""

from __future__ import annotations

import json
from typing import Any

from epochcache.cache.ledger_db import LedgerDatabase, kv, set_kv

# A listed ETag (``etag``) as reads compare one (``epochcache.sources.base.bare_etag``): without a weak
# ``W/`` mark or quotes, in lower case (stores differ in these, even between two listings of theirs).
_BARE_SQL = "lower(trim(CASE WHEN substr(etag, 1, 2) = 'W/' THEN substr(etag, 3) ELSE etag END, '\"'))"


class DaemonState:
    """The daemon's persisted state in ``db``'s ``kv``, ``listing_pages`` and ``skipped`` tables."""

    def __init__(self, db: LedgerDatabase) -> None:
        self._db = db

    def cursor(self) -> dict[str, Any] | None:
        """The sampler's position (its pass, offsets and progress per source), None before the first."""
        return self._db.get("cursor")  # type: ignore[no-any-return]

    def set_cursor(self, cursor: dict[str, Any]) -> None:
        self._db.set("cursor", cursor)

    # Each source (a stream, by its name) has its own listing header; ``""`` is the unnamed single
    # source. The listing itself is in pages, written as the listing streams in: (stream, page
    # number) -> ``(path, size, etag)`` rows; the header holds which pass, how many objects and the
    # page starts.

    def listing(self, stream: str = "") -> dict[str, Any] | None:
        """``stream``'s listing header, None if it was never listed."""
        return self._db.get("listing:" + stream)  # type: ignore[no-any-return]

    def set_listing(self, stream: str, listing: dict[str, Any]) -> None:
        self._db.set("listing:" + stream, listing)

    def listing_page(self, number: int, stream: str = "") -> list[tuple[str, int, str | None]] | None:
        """Page ``number`` of ``stream``'s listing as ``(path, size, etag)`` rows; None if absent."""
        with self._db.read() as con:
            row = con.execute("SELECT objects FROM listing_pages WHERE stream = ? AND number = ?",
                              (stream, number)).fetchone()
        return None if row is None else [(p[0], p[1], p[2] if len(p) > 2 else None) for p in json.loads(row[0])]

    def set_listing_page(self, number: int, objects: list[tuple[str, int, str | None]], stream: str = "") -> None:
        with self._db.write() as con:
            con.execute("INSERT OR REPLACE INTO listing_pages VALUES (?, ?, ?)",
                        (stream, number, json.dumps([list(o) for o in objects])))

    def drop_listing_pages(self, stream: str = "") -> None:
        with self._db.write() as con:
            con.execute("DELETE FROM listing_pages WHERE stream = ?", (stream,))

    # A new pass's listing is compared with the last one (:meth:`keep_previous_listing`, then
    # :meth:`rewritten`): the last one's pages are kept under the stream's name plus this suffix
    # (no configured name holds a NUL) until :meth:`drop_previous_listing`.
    _PREVIOUS = "\0previous"

    def keep_previous_listing(self, stream: str = "") -> None:
        """Set ``stream``'s listing pages aside (replacing any set aside before) for :meth:`rewritten`
        to compare the next listing with."""
        with self._db.write() as con:
            con.execute("DELETE FROM listing_pages WHERE stream = ?", (stream + self._PREVIOUS,))
            con.execute("UPDATE listing_pages SET stream = ? WHERE stream = ?", (stream + self._PREVIOUS, stream))

    def rewritten(self, stream: str = "") -> list[str]:
        """Paths that both ``stream``'s listing and the one set aside list, under other ETags: objects
        rewritten in place between the two. ETags are compared as reads compare them (:data:`_BARE_SQL`:
        a store that spells one ETag otherwise from one listing to the next, quoted or not, weak or not,
        in another case, rewrote nothing). (Objects gone, or listed without an ETag, are not among them:
        a listing that lost objects says nothing about the versions of those it has.)"""
        with self._db.read() as con:
            # one sort of both listings by path (a join of the two would run without an index)
            # (a path a listing gives twice, as some stores do, is still one path of both listings)
            return [path for (path,) in con.execute(
                "SELECT path FROM (SELECT path, listing, " + _BARE_SQL + " AS etag FROM (SELECT p.stream AS listing, "
                "json_extract(o.value, '$[0]') AS path, json_extract(o.value, '$[2]') AS etag FROM listing_pages p, "
                "json_each(p.objects) o WHERE p.stream IN (:old, :new))) "
                "GROUP BY path HAVING count(DISTINCT listing) = 2 AND count(etag) = count(*) "
                "AND min(etag) != max(etag)",
                {"old": stream + self._PREVIOUS, "new": stream})]

    def drop_previous_listing(self, stream: str = "") -> None:
        self.drop_listing_pages(stream + self._PREVIOUS)

    def status(self) -> dict[str, Any] | None:
        """What the daemon last said it is doing (``{"pid", "state", "since", ...}``), for status."""
        return self._db.get("daemon")  # type: ignore[no-any-return]

    def set_status(self, status: dict[str, Any]) -> None:
        self._db.set("daemon", status)

    def update_status(self, fields: dict[str, Any]) -> None:
        """Merge ``fields`` into the daemon's status (keys not named keep their values)."""
        with self._db.write() as con:
            set_kv(con, "daemon", {**(kv(con, "daemon") or {}), **fields})

    def identity(self) -> dict[str, Any] | None:
        """The dataset this cache holds (each source's url, format, columns, and the schema its rows
        produced), as recorded by the first daemon that wrote it; None for a new cache."""
        return self._db.get("identity")  # type: ignore[no-any-return]

    def set_identity(self, identity: dict[str, Any] | None) -> None:
        """Bind the cache to ``identity`` (None: unbind, when the cache is emptied on purpose)."""
        with self._db.write() as con:
            if identity is None:
                con.execute("DELETE FROM kv WHERE key = 'identity'")
            else:
                set_kv(con, "identity", identity)

    # Units skipped after their reads kept failing: unit key -> ``{"path", "size", "index", "pass",
    # "error"}`` (``index`` None: the object's metadata failed).

    def skipped(self) -> dict[str, dict[str, Any]]:
        """Every recorded skipped unit, by unit key."""
        with self._db.read() as con:
            return {unit: json.loads(info) for unit, info in con.execute("SELECT unit, info FROM skipped")}

    def digests_matched(self, url: str) -> list[str]:
        """The kinds of digest (``ETag``, ``multipart ETag``, ``CRC32`` ...) that matched a whole object
        of the source at ``url``, in any run (:mod:`epochcache.sources.digests`)."""
        return list((self._db.get("digests_matched") or {}).get(url, []))

    def remember_digest(self, url: str, kind: str) -> None:
        with self._db.write() as con:
            matched = kv(con, "digests_matched") or {}
            if kind not in matched.setdefault(url, []):
                matched[url].append(kind)
                set_kv(con, "digests_matched", matched)

    def set_skipped(self, unit_key: str, info: dict[str, Any]) -> None:
        with self._db.write() as con:
            con.execute("INSERT OR REPLACE INTO skipped VALUES (?, ?)", (unit_key, json.dumps(info)))

    def drop_skipped(self, unit_key: str) -> None:
        with self._db.write() as con:
            con.execute("DELETE FROM skipped WHERE unit = ?", (unit_key,))
