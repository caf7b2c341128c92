"""Shard records read back from shard files: each file carries its record (id, created, units in its
Arrow metadata; checksum in its name), so a ledger can be rebuilt from the files alone.

Flow: a shard folder or one file -> :class:`ShardRecord` for each file that is whole (its bytes match
the checksum in its name, its metadata names the same id); files that are not are left out.
"""

from __future__ import annotations

import os
from pathlib import Path

from epochcache.cache.layout import SHARD_SUFFIX, parse_shard_name
from epochcache.cache.ledger_records import ShardRecord
from epochcache.cache.progress import progress_bar
from epochcache.cache.shards import file_checksum, open_shard, record_meta, schema_fingerprint
from epochcache.errors import ShardCorruptError


def whole_shard(path: Path) -> ShardRecord | None:
    """The record of a shard file whose bytes match the checksum in its name; None if not one."""
    parsed = parse_shard_name(path.name)
    if parsed is None:
        return None
    shard_id, checksum = parsed
    try:
        if file_checksum(path) != checksum:
            return None
        table = open_shard(path)  # once: opening is most of the cost beside the checksum
        meta = record_meta(table.schema, path)
        nbytes = path.stat().st_size
    except (ShardCorruptError, FileNotFoundError):
        return None
    if meta.id != shard_id:
        return None
    return ShardRecord(id=shard_id, filename=path.name, nbytes=nbytes, rows=table.num_rows, created=meta.created,
                       checksum=checksum, units=meta.units, schema=schema_fingerprint(table.schema), verified=True)


def whole_shards(folder: Path, progress: bool | None = False) -> list[ShardRecord]:
    """Records of the whole shard files in ``folder`` holding no unit an earlier one holds, oldest first
    (a unit is cached once: a duplicate is the debris of a crash between publish and eviction).
    Reads every byte of every file: ``progress`` (see :mod:`epochcache.cache.progress`) counts them."""
    if not folder.is_dir():
        return []
    names = sorted(name for name in os.listdir(folder) if name.endswith(SHARD_SUFFIX))  # str: Paths sort slowly
    records = []
    with progress_bar("reading shard files", len(names), progress, unit=" shards") as bar:
        for name in names:
            if (record := whole_shard(folder / name)) is not None:
                records.append(record)
            bar.update()
    seen: set[str] = set()
    out = []
    for record in sorted(records, key=lambda r: (r.created, r.id)):
        if seen.isdisjoint(record.units):
            seen.update(record.units)
            out.append(record)
    return out
