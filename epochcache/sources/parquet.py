"""Parquet over any fsspec URL: units are row groups, read with ranged GETs or, for small objects, from one.

Flow: ``list_objects`` lists ``*.parquet``/``*.parq`` under the URL (or the one file it names);
``units`` reads an object's footer (one ranged GET of its tail, a second only for footers over
64 KiB) and caches the parsed metadata; ``read`` decodes one row group with pyarrow, verifying page
CRCs where the file has them (written with ``write_page_checksum=True``): a damaged unit raises
:class:`CorruptObjectError`, never wrong rows. The bytes come from:

- with every column read, an object up to ``whole_object_bytes``: its whole bytes
  (:mod:`epochcache.sources.wholes`: one GET for all its row groups, checked against the store's
  checksum where it offers one), decoded with the footer found in them; the footer read by ``units``
  must agree, else one of them was damaged in transit (both are read again on the retry);
- else the wanted column chunks of the row group, one ranged GET per run of neighbouring chunks (a
  single GET when all columns are wanted), each body streamed into place in a file-offset image of
  the object (over plain HTTP the footer was read twice, see :meth:`RemoteFiles.confirm`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.parquet import AlreadyBufferedFile

from epochcache.errors import CorruptObjectError, SourceError
from epochcache.sources.base import RemoteObject, Unit
from epochcache.sources.digests import DigestMemory
from epochcache.sources.files import FileSource
from epochcache.sources.footers import FooterStore
from epochcache.sources.pool import release_unused
from epochcache.sources.remote import blank_image
from epochcache.sources.wholes import KEEP_BYTES, WHOLE_OBJECT_BYTES, WholeObjects, footer_differs

_SUFFIXES = (".parquet", ".parq")
# pyarrow reads this much of the tail in its first footer read; serving it from one GET keeps
# footer parsing to a single request for typical files.
_TAIL_BYTES = 64 * 1024
# Unwanted bytes between two wanted column chunks below this are read through rather than asked
# for in a second request (a request costs about as much as this many bytes on a fast link).
_GAP_BYTES = 1 << 20


class ParquetSource(FileSource):
    """A folder (or a single file) of Parquet files at ``url``; see the module docstring."""
    suffixes = _SUFFIXES
    kind = 'Parquet'

    def __init__(
        self, url: str, columns: Sequence[str] | None = None, storage_options: dict[str, Any] | None = None,
        whole_object_bytes: int = WHOLE_OBJECT_BYTES, keep_bytes: int = KEEP_BYTES,
        footers: FooterStore | None = None, digests: DigestMemory | None = None,
    ) -> None:
        super().__init__(url, columns, storage_options, footers, digests)
        self._metadata = self._footer_cache(self._read_metadata)
        self._wholes = WholeObjects(self._remote, self._checked_metadata, whole_object_bytes, keep_bytes)

    def units(self, obj: RemoteObject) -> list[Unit]:
        """The object's row groups; each one's ``nbytes`` counts the wanted columns only (what its read
        fetches and decodes), so the daemon's bounds on bytes in flight and per shard judge them right."""
        metadata = self._metadata(obj)
        leaves = None if self.columns is None else _leaf_columns(metadata, self.columns)
        units, offset = [], 0
        for index in range(metadata.num_row_groups):
            group = metadata.row_group(index)
            nbytes = group.total_byte_size if leaves is None else sum(
                group.column(leaf).total_uncompressed_size for leaf in leaves)
            units.append(Unit(obj, index, group.num_rows, offset, nbytes))
            offset += group.num_rows
        return units

    def read(self, unit: Unit) -> pa.Table:
        """The row group's rows; a damaged page (a CRC mismatch where the file has page checksums, a
        decompression or decoding failure) raises :class:`CorruptObjectError` naming the unit."""
        # Decodes allocate from the default pool (mimalloc), which keeps what a thread allocated, and
        # the daemon has since let go, for that thread: handed back here, before this thread's next.
        release_unused()
        try:
            return self._read_whole(unit) if self._whole(unit.obj) else self._read_ranges(unit)
        except CorruptObjectError:
            # the footer may be what is wrong (it has no checksum): read it afresh on the retry
            self._forget_footer(unit.obj)
            raise

    def _read_ranges(self, unit: Unit) -> pa.Table:
        """The row group from ranged GETs of its column chunks."""
        metadata = self._metadata(unit.obj)
        runs = self._byte_ranges(metadata, unit)
        # The file's bytes up to the unit's last one, at their offsets, in an anonymous mapping:
        # only the pages the GETs write are ever backed by memory, the body streams straight into
        # them, and pyarrow decodes from the mapping in place (no copy between the socket and the decode).
        image = blank_image(max((end for _, end in runs), default=1))
        view = memoryview(image)
        for start, end in runs:
            self._remote.fetch_into(unit.obj, start, view[start:end])
        return self._decode(unit, pa.py_buffer(view), metadata)

    def _read_whole(self, unit: Unit) -> pa.Table:
        """The row group decoded from the object's whole bytes, with the footer in them (checked once,
        by :meth:`_checked_metadata`); a failed decode lets the bytes go, so the retry fetches them afresh."""
        return self._wholes.unit(unit.obj, unit.index, functools.partial(self._decode, unit),
                                 lambda metadata: metadata.num_row_groups)

    def _checked_metadata(self, obj: RemoteObject, data: pa.Buffer) -> pq.FileMetaData:
        """The metadata in an object's whole bytes, which must be the one its units were listed from:
        else one of the two was damaged in transit, and both are read again on the retry."""
        metadata = _footer(obj.path, pa.BufferReader(data))
        if not metadata.equals(self._metadata(obj)):
            raise footer_differs(obj)
        view = memoryview(data)
        self._keep_footer(obj, bytes(view[len(view) - 8 - int.from_bytes(view[-8:-4], "little") :]))
        return metadata

    def _decode(self, unit: Unit, data: pa.Buffer, metadata: pq.FileMetaData) -> pa.Table:
        """The unit's row group, keyed, from ``data`` (the file's bytes at their offsets)."""
        try:
            # pre_buffer/use_threads off: the bytes are in memory already, and no pyarrow I/O or CPU
            # pool thread may outlive the read (one alive at interpreter exit aborts it: exit 134)
            reader = pq.ParquetFile(pa.BufferReader(data), metadata=metadata, pre_buffer=False,
                                    page_checksum_verification=True)
            table = reader.read_row_group(unit.index, columns=self.columns, use_threads=False)
        except (pa.ArrowInvalid, OSError, ValueError, IndexError) as exc:
            raise CorruptObjectError(f"{unit.obj.path} row group {unit.index} ({unit.key}) is unreadable: "
                                     f"{' '.join(str(exc).split())}") from exc
        first = sum(metadata.row_group(i).num_rows for i in range(unit.index))
        return self._keyed(table, f"{unit.obj.path}:", first)

    def _whole(self, obj: RemoteObject) -> bool:
        """Whether ``obj`` is read whole: every column is wanted, and it is small enough."""
        return self.columns is None and self._wholes.wanted(obj)

    def _read_metadata(self, obj: RemoteObject) -> pq.FileMetaData:
        """The footer's metadata: kept from an earlier read of this version (:meth:`_stored_footer`),
        else read from the tail, confirmed by a second read where the whole object will not check it."""
        stored = self._stored_footer(obj)
        footer = self._fetch_footer(obj) if stored is None else stored
        # pyarrow's first read is of the last 64 KiB (or the whole file): bytes before the footer are
        # never looked at, so zeros stand in for them
        tail = bytes(max(0, min(obj.size, _TAIL_BYTES) - len(footer))) + footer
        try:
            metadata = _footer(obj.path, _buffered(obj.path, obj.size, {(obj.size - len(tail), obj.size): tail}))
        except CorruptObjectError:
            self._forget_footer(obj)
            raise
        self._check_columns(obj.path, metadata)
        if stored is None and not self._whole(obj):  # (a whole object's is kept once checked against its bytes)
            self._keep_footer(obj, footer)
        return metadata

    def _fetch_footer(self, obj: RemoteObject) -> bytes:
        """The footer's bytes (its metadata, length and magic) from a GET of the object's tail."""
        tail = self._remote.fetch(obj, max(0, obj.size - _TAIL_BYTES), obj.size)
        if len(tail) < 8 or tail[-4:] != b"PAR1":
            raise CorruptObjectError(f"{obj.path} is not a Parquet file (no PAR1 magic at its end)")
        needed = int.from_bytes(tail[-8:-4], "little") + 8
        if needed > obj.size:
            raise CorruptObjectError(f"{obj.path} is not a Parquet file (its footer length {needed} exceeds "
                                     "its size)")
        if needed > len(tail):
            tail = self._remote.fetch(obj, obj.size - needed, obj.size)
        footer = tail[len(tail) - needed :]
        if not self._whole(obj):
            self._remote.confirm(obj, obj.size - needed, footer)
        return footer

    def _check_columns(self, path: str, metadata: pq.FileMetaData) -> None:
        if self.columns is None:
            return
        present = set(metadata.schema.to_arrow_schema().names)
        missing = [c for c in self.columns if c not in present]
        if missing:
            raise SourceError(
                f"source.columns names {missing} absent from {path}: present are {sorted(present)}"
            )

    def _byte_ranges(self, metadata: pq.FileMetaData, unit: Unit) -> list[tuple[int, int]]:
        """The spans of file bytes holding the unit's row group chunks of the wanted columns, one per
        run of neighbouring chunks: unwanted columns between two runs are skipped, not downloaded,
        unless the gap is smaller than :data:`_GAP_BYTES` (cheaper to read than to ask twice).
        A chunk the footer places outside the file (a damaged footer) is :class:`CorruptObjectError`."""
        group = metadata.row_group(unit.index)
        spans = []
        for leaf in _leaf_columns(metadata, self.columns):
            chunk = group.column(leaf)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                start = min(start, chunk.dictionary_page_offset)
            end = start + chunk.total_compressed_size
            if start < 0 or not start <= end <= unit.obj.size:
                raise CorruptObjectError(f"{unit.obj.path}: its footer places row group {unit.index}'s column {leaf} "
                                         f"at bytes {start}-{end}, outside the file's {unit.obj.size}")
            spans.append((start, end))
        runs: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if runs and start - runs[-1][1] <= _GAP_BYTES:
                runs[-1] = (runs[-1][0], max(runs[-1][1], end))
            else:
                runs.append((start, end))
        return runs



def _footer(path: str, file: pa.BufferReader | AlreadyBufferedFile) -> pq.FileMetaData:
    """The metadata in the footer at the end of ``file``; :class:`CorruptObjectError` if unreadable."""
    try:
        return pq.read_metadata(file)
    except (pa.ArrowInvalid, OSError, ValueError, IndexError) as exc:
        raise CorruptObjectError(f"{path}: unreadable Parquet footer: {' '.join(str(exc).split())}") from exc


def _buffered(path: str, size: int, parts: dict[tuple[int, int], bytes]) -> AlreadyBufferedFile:
    """A read-only file over already fetched byte ranges; reading outside them is an error."""
    return AlreadyBufferedFile(
        fs=None, path=path, mode="rb", cache_type="parts", cache_options={"data": parts}, size=size
    )


def _leaf_columns(metadata: pq.FileMetaData, columns: Sequence[str] | None) -> list[int]:
    """Indices of the Parquet leaf columns that store the top-level ``columns`` (None = all).

    Matched by position, not by dotted path, so a column named ``"a.b"`` is not mistaken for
    field ``b`` of a struct ``a``.
    """
    schema = metadata.schema.to_arrow_schema()
    wanted = set(schema.names if columns is None else columns)
    leaves: list[int] = []
    first = 0
    for field in schema:
        count = _leaf_count(field.type)
        if field.name in wanted:
            leaves.extend(range(first, first + count))
        first += count
    return leaves


def _leaf_count(arrow_type: pa.DataType) -> int:
    if isinstance(arrow_type, pa.ExtensionType):
        return _leaf_count(arrow_type.storage_type)
    if pa.types.is_struct(arrow_type):
        return sum(_leaf_count(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    if pa.types.is_map(arrow_type):
        return _leaf_count(arrow_type.key_type) + _leaf_count(arrow_type.item_type)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return _leaf_count(arrow_type.value_type)
    return 1
