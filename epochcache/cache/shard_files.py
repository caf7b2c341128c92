"""Shard records read back from shard files: each file carries its record (id, created, units in its
Arrow metadata; checksum in its name), so a ledger can be rebuilt from the files alone.

Flow: a shard folder or one file -> :class:`ShardRecord` for each file that is whole (its bytes match
the checksum in its name, its metadata names the same id); files that are not are left out.
"""

from __future__ import annotations

from pathlib import Path

from epochcache.cache.layout import SHARD_SUFFIX, parse_shard_name
from epochcache.cache.ledger_records import ShardRecord
from epochcache.cache.shards import file_checksum, open_shard, read_record_meta, schema_fingerprint
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
        meta, rows = read_record_meta(path)
        schema = schema_fingerprint(open_shard(path).schema)
        nbytes = path.stat().st_size
    except (ShardCorruptError, FileNotFoundError):
        return None
    if meta.id != shard_id:
        return None
    return ShardRecord(id=shard_id, filename=path.name, nbytes=nbytes, rows=rows, created=meta.created,
                       checksum=checksum, units=meta.units, schema=schema, verified=True)


def whole_shards(folder: Path) -> list[ShardRecord]:
    """Records of the whole shard files in ``folder`` holding no unit an earlier one holds, oldest first
    (a unit is cached once: a duplicate is the debris of a crash between publish and eviction)."""
    if not folder.is_dir():
        return []
    records = [r for p in sorted(folder.glob("*" + SHARD_SUFFIX)) if (r := whole_shard(p)) is not None]
    seen: set[str] = set()
    out = []
    for record in sorted(records, key=lambda r: (r.created, r.id)):
        if seen.isdisjoint(record.units):
            seen.update(record.units)
            out.append(record)
    return out
