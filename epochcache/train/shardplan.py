"""ShardPlan: where each column's buffers lie in a shard file, so that a shard mapped before is mapped
again with one ``mmap`` and no Arrow IPC parsing.

In: the arrays of a shard opened the full way (:func:`open_planned`: an ``mmap`` read by Arrow's IPC
reader) and the address of its mapping; out: a plan that, for the same file, rebuilds the same arrays
zero-copy over a fresh map. Parsing a shard's IPC footer costs ~60-90 us here; a remap ~10 us. That
matters when an epoch spans more shards than ``max_open_shards``: a shuffled batch then maps most of
its shards again.

Invariant: a shard file never changes under its name (the name carries its checksum), so the offsets
found once stay true. Only flat layouts are planned (numbers, fixed-size lists of them, the
fixed-shape tensor type, binary and string); for other columns :func:`plan` gives None and the
caller opens the shard the full way each time.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import pyarrow as pa

from epochcache.errors import ShardCorruptError

Span = tuple[int, int] | None  # (offset in the file, size) of one buffer; None for an absent buffer


@dataclass(frozen=True)
class _ArrayPlan:
    type: pa.DataType
    length: int
    null_count: int
    offset: int
    buffers: tuple[Span, ...]
    child: _ArrayPlan | None  # the values of a fixed-size list, or an extension type's storage

    def build(self, whole: pa.Buffer) -> pa.Array:
        if isinstance(self.type, pa.BaseExtensionType):
            assert self.child is not None  # plan() gives extension types their storage
            return pa.ExtensionArray.from_storage(self.type, self.child.build(whole))
        buffers = [None if span is None else whole.slice(*span) for span in self.buffers]
        children = None if self.child is None else [self.child.build(whole)]
        return pa.Array.from_buffers(self.type, self.length, buffers, self.null_count, self.offset, children)


@dataclass(frozen=True)
class ShardPlan:
    """Column name -> its arrays' layout in one shard file."""

    columns: dict[str, _ArrayPlan]

    def remap(self, path: str) -> tuple[dict[str, pa.Array], mmap.mmap]:
        """The shard's columns over a fresh read-only map of ``path`` (zero-copy), and the map."""
        mapped, whole = map_file(path)
        return {name: column.build(whole) for name, column in self.columns.items()}, mapped


def plan(arrays: dict[str, pa.Array], base_address: int) -> ShardPlan | None:
    """The plan of ``arrays`` (all zero-copy views of one mapping starting at ``base_address``), or None
    if a column has a layout this module does not plan."""
    columns = {}
    for name, array in arrays.items():
        column = _plan_array(array, base_address)
        if column is None:
            return None
        columns[name] = column
    return ShardPlan(columns)


def _plan_array(array: pa.Array, base: int) -> _ArrayPlan | None:
    kind = array.type
    if isinstance(kind, pa.BaseExtensionType):
        storage = _plan_array(array.storage, base)
        return None if storage is None else _ArrayPlan(kind, len(array), array.null_count, 0, (), storage)
    if pa.types.is_fixed_size_list(kind):
        values = _plan_array(array.values, base)
        if values is None:
            return None
        own = array.buffers()[:1]
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind):
        values, own = None, array.buffers()
    else:
        return None
    spans = tuple(None if b is None else (b.address - base, b.size) for b in own)
    return _ArrayPlan(kind, len(array), array.null_count, array.offset, spans, values)


def map_file(path: str) -> tuple[mmap.mmap, pa.Buffer]:
    """A read-only shared map of ``path`` and a buffer over all of it, which holds the map: it is
    unmapped when the last buffer or array built on it goes (and the map object with it)."""
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ShardCorruptError(f"shard {path} is not a valid Arrow IPC file: {exc}") from exc
    return mapped, pa.py_buffer(mapped)


def open_planned(path: str) -> tuple[dict[str, pa.Array], pa.Schema, ShardPlan | None, mmap.mmap]:
    """A shard opened the full way (as :func:`epochcache.cache.shards.open_shard`): its columns, schema,
    the plan of all its columns (None if one is not plannable), and the map they lie in."""
    mapped, whole = map_file(path)
    try:
        table = pa.ipc.open_file(pa.BufferReader(whole)).read_all()
    except pa.ArrowInvalid as exc:
        raise ShardCorruptError(f"shard {path} is not a valid Arrow IPC file: {exc}") from exc
    arrays = {name: _one_chunk(column) for name, column in zip(table.column_names, table.columns)}
    return arrays, table.schema, plan(arrays, whole.address), mapped


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    # Shards hold one record batch, so this is the one chunk itself, not a copy.
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
