"""What fixes the meaning of a cache dir: each stream's order (its cursor is meaningless under
another) and the dataset the cache holds (the schema of the rows in its shards).

In: the config's sources, the ledger's cursor, listings and identity. Out: the position to resume
from, and :class:`DatasetBinding`, which raises :class:`DatasetMismatchError` before a row of
another schema is written. Invariant: every shard of a cache dir holds rows of one schema, so a
batch never mixes shards whose columns differ.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from epochcache.cache.ledger import Ledger
from epochcache.cache.shards import schema_fingerprint
from epochcache.config import Config
from epochcache.errors import DatasetMismatchError, SourceError
from epochcache.sync.mixing import MixCursor
from epochcache.sync.notes import note
from epochcache.sync.sampler import Cursor
from epochcache.sync.stream import Stream

log = logging.getLogger(__name__)

_HOW_TO_GO_ON = ("use a new cache.dir for this dataset, or empty this one with `epochcache clear --config "
                 "<config file>` (its shards are deleted)")


def stream_order(config: Config, stream: Stream) -> list[object]:
    """What fixes a stream's order; its cursor is meaningless under another one."""
    sampler, source = config.sampler, stream.config
    rank, nodes = sampler.partition()
    order: list[object] = ["v2", source.url, source.format, source.columns, source.labels, sampler.seed,
                           sampler.mix_units, rank, nodes]
    # Only a fraction below 1 joins, so the order of a cache from before the key stays the same.
    return order + [sampler.row_fraction] if sampler.row_fraction != 1 else order


def recorded_splits(ledger: Ledger) -> list[tuple[str, int, int, int]]:
    """How the daemon that filled this cache split each of its remotes among nodes, as its listings
    recorded it (:func:`stream_order`): ``(source url, sampler seed, node_rank, num_nodes)`` per
    source listed so far; empty before the daemon's first listing."""
    cursor = ledger.daemon.cursor() or {}
    names = list(cursor["streams"]) if "streams" in cursor else [""]
    splits = []
    for name in names:
        order = (ledger.daemon.listing(name) or {}).get("order")
        if order and order[0] == "v2":
            splits.append((str(order[1]), int(order[5]), int(order[7]), int(order[8])))
    return splits


def resume_position(config: Config, ledger: Ledger, streams: Sequence[Stream]) -> MixCursor:
    """Where to go on from: the ledger's cursor, each stream's afresh if it was left by another
    remote order."""
    position = MixCursor.from_dict(ledger.daemon.cursor(), [s.name for s in streams])
    for stream in streams:
        listing = ledger.daemon.listing(stream.name)
        if listing and listing.get("order") != stream_order(config, stream):
            log.warning("source %r: url, format, columns, labels, sampler.seed, sampler.mix_units or the "
                        "node partition changed since the last run: starting a new order from its first "
                        "pass; cached shards rotate out as usual", stream.name or stream.config.url)
            ledger.daemon.set_listing(stream.name, {})
            ledger.daemon.drop_listing_pages(stream.name)
            position = MixCursor({**position.cursors, stream.name: Cursor()}, position.rows)
    return position


def columns_text(schema: pa.Schema) -> str:
    """``[name: type, ...]``: a schema as messages and the ledger's identity show it."""
    return "[" + ", ".join(f"{field.name}: {field.type}" for field in schema) + "]"


class DatasetBinding:
    """Binds a cache dir to one dataset: each source's url, format, columns, labels, and the schema
    its rows produced (ledger ``identity``).

    :meth:`bind` (at start) refuses a config whose sources select other columns or labels than the
    cached rows were made with; :meth:`check` (each table read) refuses rows of another schema than
    the shards hold. A cache with no shard takes any dataset (there is nothing to mix with).
    """

    def __init__(self, ledger: Ledger, config: Config, has_shards: bool) -> None:
        """``has_shards``: whether the cache holds shards; a cache written before it recorded its
        dataset is checked against its shards' schema fingerprints."""
        self.ledger, self.config = ledger, config
        self._sources = [{"name": s.name, "url": s.url, "format": s.format, "columns": s.columns,
                          "labels": s.labels} for s in config.sources]
        bound = ledger.daemon.identity() if has_shards else None
        self._fingerprints = ledger.schemas() if has_shards and not bound else set()
        self._schema: str | None = bound.get("schema") if bound else None
        self._first: str = bound.get("schema_from", "") if bound else ""
        self._run: tuple[str, str] | None = None  # (source, columns) of this run's first rows
        if bound:
            self._refuse_changed_selection(bound.get("sources", []))
        note(ledger.daemon.set_identity, {"sources": self._sources, "schema": self._schema, "schema_from": self._first})

    def check(self, source: str, key: str, schema: pa.Schema) -> None:
        """Take in the schema of rows read (of ``key``, from ``source``). Raises
        :class:`SourceError` if it differs from earlier rows of this run (two sources of other
        columns), :class:`DatasetMismatchError` if it differs from the rows already cached."""
        text = columns_text(schema)
        if self._run is None:
            self._run = (source, text)
        elif text != self._run[1]:
            raise SourceError(
                f"{key} (source {source!r}) has columns {text} but earlier rows (source {self._run[0]!r}) "
                f"have {self._run[1]}: shards mix every source's rows, so give all sources the same columns "
                "and types (select them with each source's columns key)"
            )
        if self._schema is None and self._fingerprints and schema_fingerprint(schema) not in self._fingerprints:
            raise DatasetMismatchError(
                f"{key} (source {source!r}) has columns {text}, which no shard in {self.config.cache.dir} "
                f"holds (they were written before the cache recorded its dataset): {_HOW_TO_GO_ON}"
            )
        if self._schema is None:
            self._schema, self._first = text, key
            note(self.ledger.daemon.set_identity, {"sources": self._sources, "schema": text, "schema_from": key})
        elif text != self._schema:
            raise DatasetMismatchError(
                f"{key} (source {source!r}) has columns {text} but the rows cached in {self.config.cache.dir} "
                f"(first from {self._first}) have {self._schema}: a cache dir holds one dataset; {_HOW_TO_GO_ON}"
            )

    def _refuse_changed_selection(self, bound: list[dict[str, Any]]) -> None:
        before = {entry.get("name", ""): entry for entry in bound}
        for now in self._sources:
            old = before.get(now["name"])
            if old is None:
                continue
            for key in ("columns", "labels"):
                if old.get(key) != now[key]:
                    name = f"source {now['name']!r}" if now["name"] else "source"
                    raise DatasetMismatchError(
                        f"{name}.{key} is {now[key]!r} but the shards in {self.config.cache.dir} were made "
                        f"with {old.get(key)!r} (columns {self._schema}): {_HOW_TO_GO_ON}, or set "
                        f"{key} back to {old.get(key)!r}"
                    )
