"""Shard files: Arrow IPC (Feather v2), uncompressed, one record batch each.

Uncompressed and a single record batch so that a reader can memory-map a shard and view each
fixed-width column as one numpy array without copying (see :mod:`epochcache.dataset`).

Writing is atomic: the bytes go to ``<id>.arrow.tmp`` in the shard folder, are fsynced, renamed to
``<id>.arrow`` with ``os.replace`` and the folder is fsynced, so a crash leaves either no shard or a
whole one. The checksum (BLAKE2b-128 of the file) is computed before the rename and recorded in the
ledger; readers compare against it the first time they open a shard.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow as pa

from epochcache.errors import ShardCorruptError

_CHECKSUM = "blake2b"
_DIGEST_BYTES = 16


def encoded_size(table: pa.Table) -> int:
    """Exact size in bytes of the shard file ``write_shard`` would produce, without writing it."""
    sink = pa.MockOutputStream()
    _write_ipc(sink, table)
    return int(sink.size())


def write_shard(table: pa.Table, tmp_path: Path, final_path: Path) -> str:
    """Write ``table`` (one chunk per column) atomically to ``final_path``; return its checksum.

    On any failure the temp file is removed and nothing appears at ``final_path``.
    """
    try:
        with pa.OSFile(str(tmp_path), "wb") as sink:
            _write_ipc(sink, table)
        checksum = file_checksum(tmp_path, fsync=True)
        os.replace(tmp_path, final_path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    _fsync_dir(final_path.parent)
    return checksum


def file_checksum(path: Path, fsync: bool = False) -> str:
    """Hex BLAKE2b-128 of a file's bytes; with ``fsync`` also flush them to stable storage."""
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        return hashlib.file_digest(f, lambda: hashlib.new(_CHECKSUM, digest_size=_DIGEST_BYTES)).hexdigest()


def open_shard(path: Path) -> pa.Table:
    """Memory-map a shard and return its table; buffers point into the mapping (zero-copy)."""
    try:
        source = pa.memory_map(str(path), "r")
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as exc:
        raise ShardCorruptError(f"shard {path} is not a valid Arrow IPC file: {exc}") from exc


def verify_shard(path: Path, checksum: str) -> None:
    """Raise :class:`ShardCorruptError` unless the file's checksum is ``checksum``."""
    actual = file_checksum(path)
    if actual != checksum:
        raise ShardCorruptError(
            f"shard {path} has checksum {actual}, the ledger recorded {checksum}: "
            "the file was changed or damaged after it was published; run `epochcache sync` to refill"
        )


def _write_ipc(sink: pa.NativeFile, table: pa.Table) -> None:
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(table.num_rows, 1))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
