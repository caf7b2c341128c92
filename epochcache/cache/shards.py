"""Shard files: Arrow IPC (Feather v2), uncompressed, one record batch each.

Uncompressed and a single record batch so that a reader can memory-map a shard and view each
fixed-width column as one numpy array without copying (see :mod:`epochcache.train.dataset`).

Writing is atomic: the bytes go to ``<id>.arrow.tmp`` in the shard folder, are fsynced, checksummed
(read back from the page cache), renamed to their final name with ``os.replace`` and the folder is
fsynced, so a crash leaves either no shard or a whole one. The checksum (XXH3-128 of the file: it
detects damage, it is not a defence against tampering, and at ~10 GB/s it costs the daemon and a
reader's first open next to nothing) becomes part of the final
name (see :mod:`epochcache.cache.layout`) and is recorded in the ledger; readers compare against it the
first time they open a shard.

Each file also carries, in its Arrow schema metadata, what its ledger record needs (id, creation
time, unit keys: :func:`with_record_meta`), so a whole shard whose record was lost in a crash can be
re-recorded (adopted) after its checksum is checked against its name.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pyarrow as pa
import xxhash

from epochcache.errors import ShardCorruptError

_META = b"epochcache.shard"
# Shard files are written at most this many bytes per write(2), because the page cache keeps a file in
# folios no larger than the writes that filled it, and Linux (6.18 on) maps a whole folio into a
# reader at its first touch. Written in one call, a shard sat in folios of up to 2 MiB (ext4, XFS): a
# trainer reading one 12 KB row mapped 1-2 MiB (its RSS and PSS count them; with
# loader.max_mapped_bytes, a batch of 64 rows mapped ~100 MiB between two releases). In 64 KiB writes
# it maps 64 KiB, the kernel's fault-around window, as on kernels without large folios (as long as
# the page cache holds the shard as written: read back from disk, readahead sizes the folios). It
# also costs the daemon less: 1.20-1.31 s of CPU against 1.62-1.75 in the ingest benchmark (large
# folios are dear to allocate), though a tight loop rewriting one 64 MB file takes 0.022 s in 64 KiB
# writes against 0.013 s in one.
WRITE_CHUNK = 64 << 10


@dataclass(frozen=True)
class ShardMeta:
    """The record fields a shard file carries about itself (see :func:`with_record_meta`)."""

    id: str
    created: float
    units: tuple[str, ...]


def with_record_meta(table: pa.Table, meta: ShardMeta) -> pa.Table:
    """``table`` with ``meta`` added to its schema metadata (a zero-copy schema swap)."""
    value = json.dumps({"id": meta.id, "created": meta.created, "units": list(meta.units)}).encode()
    return table.replace_schema_metadata({**(table.schema.metadata or {}), _META: value})


def read_record_meta(path: Path) -> tuple[ShardMeta, int]:
    """The :class:`ShardMeta` and row count of a shard file; :class:`ShardCorruptError` if it has none."""
    table = open_shard(path)
    return record_meta(table.schema, path), table.num_rows


def record_meta(schema: pa.Schema, path: Path) -> ShardMeta:
    """The :class:`ShardMeta` in the schema of the shard at ``path`` (opened by the caller, who may need
    more of it: opening an IPC file is most of what reading its record costs); :class:`ShardCorruptError`
    if it has none."""
    raw = (schema.metadata or {}).get(_META, b"")
    try:
        data = json.loads(raw)
        meta = ShardMeta(id=str(data["id"]), created=float(data["created"]), units=tuple(map(str, data["units"])))
    except (TypeError, ValueError, KeyError) as exc:
        raise ShardCorruptError(
            f"shard {path} carries no valid epochcache record metadata ({exc!r}): it was not written by "
            "this version of epochcache; delete it or run `epochcache verify --fix`"
        ) from exc
    return meta


def schema_fingerprint(schema: pa.Schema) -> str:
    """A short stable hash of a schema's fields (names, types, nullability; metadata ignored): shards
    with equal fingerprints can be gathered into one batch."""
    fields = schema.remove_metadata()
    return xxhash.xxh3_64(fields.serialize().to_pybytes()).hexdigest()


def encoded_size(table: pa.Table) -> int:
    """Exact size in bytes of the shard file ``write_shard`` would produce, without writing it."""
    sink = pa.MockOutputStream()
    _write_ipc(sink, table)
    return int(sink.size())


def write_shard(table: pa.Table, tmp_path: Path, final_path: Path | Callable[[str], Path]) -> str:
    """Write ``table`` (one chunk per column) atomically; return its checksum.

    ``final_path`` is the file's final path, or a function of the checksum that gives it (the layout
    puts the checksum in the name). On any failure (ENOSPC included) the temp file is removed,
    nothing appears at the final path and the error propagates.
    """
    try:
        _write_file(tmp_path, table)
        checksum = file_checksum(tmp_path)  # read back from the page cache: cheaper than a copy in memory
        final = final_path if isinstance(final_path, Path) else final_path(checksum)
        os.replace(tmp_path, final)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    _fsync(final.parent)
    return checksum


def file_checksum(path: Path) -> str:
    """Hex XXH3-128 of a file's bytes (what :func:`write_shard` returned for it)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses empty files
            return xxhash.xxh3_128().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_128(mapped).hexdigest()


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


def _write_file(path: Path, table: pa.Table) -> None:
    """Create ``path`` holding ``table`` as IPC, flushed to stable storage (where tests inject faults)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with pa.PythonFile(ChunkedWrites(partial(os.write, fd)), mode="w") as sink:
            _write_ipc(sink, table)
        os.fsync(fd)
    finally:
        os.close(fd)


class ChunkedWrites:
    """A file object for :class:`pyarrow.PythonFile` that hands what it is given to ``write`` (a
    write(2) of one descriptor: takes bytes, returns how many it wrote) in pieces of at most
    :data:`WRITE_CHUNK` bytes, in order, none copied (pyarrow hands over its buffers)."""

    def __init__(self, write: Callable[[memoryview], int]) -> None:
        self._write, self.closed = write, False

    def write(self, data: bytes | pa.Buffer) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_CHUNK):
            piece = view[start:start + WRITE_CHUNK]
            while piece:  # write(2) may take less than asked (a signal, a nearly full disk)
                piece = piece[self._write(piece):]
        return len(view)

    def flush(self) -> None:
        """Nothing is buffered here."""

    def close(self) -> None:
        self.closed = True


def _fsync(path: Path) -> None:
    """Flush a file's, or a folder's, contents to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
