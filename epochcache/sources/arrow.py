"""Arrow IPC files (Feather v2) over any fsspec URL: units are record batches.

Flow: ``list_objects`` lists ``*.arrow``/``*.feather``/``*.ipc`` under the URL; ``units`` reads the
file's footer (one ranged GET of its tail, a second only for footers over 64 KiB), takes the schema
from it with pyarrow and the byte span of every record batch (its *Block*) from the footer's
flatbuffer; ``read`` decodes one batch's span (metadata and body) with pyarrow, zero-copy, from:

- an object up to ``whole_object_bytes``: its whole bytes (:mod:`epochcache.sources.wholes`: one GET
  for all its batches, checked against the store's checksum where it offers one), with the footer
  found in them; the footer read by ``units`` must agree, else one of them was damaged in transit
  (both are read again on the retry);
- a larger one: one ranged GET of the span (over plain HTTP the footer was read twice, see
  :meth:`RemoteFiles.confirm`; the batch's bytes cannot be checked: Arrow IPC has no checksums).

A row's key is ``<object path>:<batch>.<row in batch>``: the footer does not hold row counts, and
reading every batch's metadata to number rows file-wide would cost a GET per batch before any data.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from epochcache.errors import CorruptObjectError, SourceError
from epochcache.sources.base import RemoteObject, Unit
from epochcache.sources.digests import DigestMemory
from epochcache.sources.files import FileSource
from epochcache.sources.footers import FooterStore
from epochcache.sources.remote import blank_image
from epochcache.sources.wholes import KEEP_BYTES, WHOLE_OBJECT_BYTES, WholeObjects, footer_differs

_SUFFIXES = (".arrow", ".feather", ".ipc")
_MAGIC = b"ARROW1"
_TAIL_BYTES = 64 * 1024
_BLOCK = struct.Struct("<qi4xq")  # flatbuffers struct Block: offset, metaDataLength, (pad), bodyLength


@dataclass(frozen=True)
class _Footer:
    schema: pa.Schema
    blocks: tuple[tuple[int, int], ...]  # (start, end) byte span of each record batch


class ArrowSource(FileSource):
    """A folder (or a single file) of Arrow IPC files at ``url``; see the module docstring."""
    suffixes = _SUFFIXES
    kind = 'Arrow IPC'

    def __init__(
        self, url: str, columns: Sequence[str] | None = None, storage_options: dict[str, Any] | None = None,
        whole_object_bytes: int = WHOLE_OBJECT_BYTES, keep_bytes: int = KEEP_BYTES,
        footers: FooterStore | None = None, digests: DigestMemory | None = None,
    ) -> None:
        super().__init__(url, columns, storage_options, footers, digests)
        self._footer = self._footer_cache(self._read_footer)
        self._wholes = WholeObjects(self._remote, self._checked_footer, whole_object_bytes, keep_bytes)

    def units(self, obj: RemoteObject) -> list[Unit]:
        """One unit per record batch; ``rows`` is None (known once read), ``nbytes`` its body size."""
        footer = self._footer(obj)
        return [Unit(obj, index, None, None, end - start) for index, (start, end) in enumerate(footer.blocks)]

    def read(self, unit: Unit) -> pa.Table:
        """The record batch's rows; one that does not decode raises :class:`CorruptObjectError`."""
        try:
            return self._read_whole(unit) if self._wholes.wanted(unit.obj) else self._read_range(unit)
        except CorruptObjectError:
            # the footer may be what is wrong (it has no checksum): read it afresh on the retry
            self._forget_footer(unit.obj)
            raise

    def _read_range(self, unit: Unit) -> pa.Table:
        """The record batch from a ranged GET of its span."""
        footer = self._footer(unit.obj)
        start, end = _block(unit, footer)
        # The batch streams into an anonymous mapping and is decoded in place: its columns are views
        # of the bytes as they came off the socket (no copy on the way).
        image = blank_image(end - start)
        self._remote.fetch_into(unit.obj, start, memoryview(image)[: end - start])
        return self._decode(unit, footer, pa.py_buffer(image)[: end - start])

    def _read_whole(self, unit: Unit) -> pa.Table:
        """The batch decoded from the object's whole bytes, with the footer in them (checked once, by
        :meth:`_checked_footer`); a failed decode lets the bytes go, so the retry fetches them afresh."""
        return self._wholes.unit(unit.obj, unit.index, functools.partial(self._batch_of, unit),
                                 lambda footer: len(footer.blocks))

    def _batch_of(self, unit: Unit, data: pa.Buffer, footer: _Footer) -> pa.Table:
        start, end = _block(unit, footer)
        return self._decode(unit, footer, data[start:end])

    def _checked_footer(self, obj: RemoteObject, data: pa.Buffer) -> _Footer:
        """The footer in an object's whole bytes, which must be the one its units were listed from
        (schema metadata included: tensor shapes live there): else one of the two was damaged in
        transit, and both are read again on the retry."""
        footer = self._parse_footer(obj, memoryview(data))
        listed = self._footer(obj)
        if footer.blocks != listed.blocks or not footer.schema.equals(listed.schema, check_metadata=True):
            raise footer_differs(obj)
        view = memoryview(data)
        self._keep_footer(obj, bytes(view[len(view) - 10 - _footer_length(obj, view) :]))
        return footer

    def _decode(self, unit: Unit, footer: _Footer, data: pa.Buffer) -> pa.Table:
        """The record batch in ``data`` (its span: metadata and body) as the unit's keyed rows, zero-copy."""
        try:
            batch = pa.ipc.read_record_batch(pa.ipc.read_message(data), footer.schema)
            batch.validate(full=True)  # offsets, lengths, UTF-8: damage pyarrow would otherwise read past
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            raise CorruptObjectError(f"{unit.obj.path}: record batch {unit.index} ({unit.key}) is unreadable: "
                                     f"{' '.join(str(exc).split())}") from exc
        table = pa.Table.from_batches([batch])
        if self.columns is not None:
            table = table.select(self.columns)
        return self._keyed(table, f"{unit.obj.path}:{unit.index}.", 0)

    def _read_footer(self, obj: RemoteObject) -> _Footer:
        """The footer: kept from an earlier read of this version (:meth:`_stored_footer`), else read
        from a GET of the object's tail, confirmed by a second read where the object's whole read
        will not check it (a larger object over plain HTTP)."""
        stored = self._stored_footer(obj)
        tail = self._fetch_footer(obj) if stored is None else stored
        try:
            footer = self._parse_footer(obj, tail)
        except CorruptObjectError:
            self._forget_footer(obj)
            raise
        if stored is None and not self._wholes.wanted(obj):  # (a whole object's: once checked against its bytes)
            self._keep_footer(obj, tail)
        return footer

    def _fetch_footer(self, obj: RemoteObject) -> bytes:
        """The footer's bytes (the footer, its length and the magic) from a GET of the object's tail."""
        tail = self._remote.fetch(obj, max(0, obj.size - _TAIL_BYTES), obj.size)
        length = _footer_length(obj, tail)
        if length + 10 > len(tail):
            tail = self._remote.fetch(obj, obj.size - length - 10, obj.size)
        footer = tail[len(tail) - 10 - length :]
        if not self._wholes.wanted(obj):
            self._remote.confirm(obj, obj.size - length - 10, footer)
        return footer

    def _parse_footer(self, obj: RemoteObject, tail: bytes | memoryview) -> _Footer:
        """The footer at the end of ``tail`` (the object's last bytes, the whole footer among them)."""
        length = _footer_length(obj, tail)
        if length + 10 > len(tail):
            raise CorruptObjectError(f"{obj.path}: its Arrow IPC footer ({length} bytes) is longer than the file")
        footer = tail[len(tail) - 10 - length : len(tail) - 10]
        try:
            # pyarrow reads the schema from the footer bytes framed as a file with no batches
            schema = pa.ipc.open_file(pa.py_buffer(_MAGIC + b"\0\0" + tail[len(tail) - 10 - length :])).schema
            blocks = tuple((offset, offset + meta + body) for offset, meta, body in _record_blocks(footer))
        except (pa.ArrowInvalid, OSError, struct.error, IndexError) as exc:
            raise CorruptObjectError(f"{obj.path}: unreadable Arrow IPC footer: {' '.join(str(exc).split())}") from exc
        if any(start < 0 or end < start or end > obj.size for start, end in blocks):
            raise CorruptObjectError(f"{obj.path}: a record batch lies beyond the end of the file")
        self._check_columns(obj.path, schema)
        return _Footer(schema, blocks)

    def _check_columns(self, path: str, schema: pa.Schema) -> None:
        missing = [c for c in self.columns or () if c not in schema.names]
        if missing:
            raise SourceError(f"source.columns names {missing} absent from {path}: present are {schema.names}")


def _block(unit: Unit, footer: _Footer) -> tuple[int, int]:
    """The byte span of the unit's record batch; :class:`CorruptObjectError` if the footer has none."""
    if unit.index >= len(footer.blocks):
        raise CorruptObjectError(f"{unit.obj.path} has {len(footer.blocks)} record batches, not "
                                 f"{unit.key}'s: its footer was damaged when first read")
    return footer.blocks[unit.index]


def _footer_length(obj: RemoteObject, tail: bytes | memoryview) -> int:
    """The footer's length from the last 10 bytes of the object (``tail``'s end): its length, ARROW1."""
    if len(tail) < 10 or bytes(tail[-6:]) != _MAGIC:
        raise CorruptObjectError(f"{obj.path} is not an Arrow IPC file (no ARROW1 magic at its end)")
    length = int.from_bytes(tail[-10:-6], "little", signed=True)
    if not 0 < length <= obj.size - 10:
        raise CorruptObjectError(f"{obj.path} is not an Arrow IPC file (footer length {length} for "
                                 f"{obj.size} bytes)")
    return length


def _record_blocks(footer: bytes | memoryview) -> list[tuple[int, int, int]]:
    """The ``recordBatches`` vector (field 3) of the Footer flatbuffer: (offset, metaDataLength, bodyLength)."""
    table = int.from_bytes(footer[0:4], "little")
    vtable = table - int.from_bytes(footer[table : table + 4], "little", signed=True)
    vtable_size = int.from_bytes(footer[vtable : vtable + 2], "little")
    slot = vtable + 4 + 2 * 3
    if slot + 2 > vtable + vtable_size:
        return []
    field = int.from_bytes(footer[slot : slot + 2], "little")
    if field == 0:
        return []
    vector = table + field + int.from_bytes(footer[table + field : table + field + 4], "little")
    count = int.from_bytes(footer[vector : vector + 4], "little")
    return [_BLOCK.unpack_from(footer, vector + 4 + i * _BLOCK.size) for i in range(count)]
