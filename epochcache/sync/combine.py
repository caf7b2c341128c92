"""A shard's rows as one chunk per column, copied from its units' tables one unit at a time.

In: the units' tables, in order (the list is emptied). Out: one table, one chunk per column, equal
to ``pa.concat_tables(tables).combine_chunks()``. Invariant: a unit's table is let go as soon as its
rows are copied, so the units and the shard are not both held whole: a column of fixed-size values
without nulls (numbers, fixed-size binary, fixed-size lists and tensors of them: nearly all the bytes
of a training set) is copied into an anonymous mapping of the shard's size (:func:`blank_image`),
backed only as it is written and unmapped once the shard is let go. Other columns are concatenated
at the end, in ``pool``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from epochcache.sources.remote import blank_image


def combine(tables: list[pa.Table], pool: pa.MemoryPool) -> pa.Table:
    """The rows of ``tables`` (all of one schema) as one chunk per column; ``tables`` ends empty."""
    if len(tables) == 1:  # columns of one chunk are taken as they are, without a copy
        return tables.pop().combine_chunks(memory_pool=pool)
    schema = tables[0].schema
    rows = sum(table.num_rows for table in tables)
    sinks: list[_Fixed | _Chunks] = []
    for index, field in enumerate(schema):
        width = _row_bytes(field.type)
        flat = width is not None and all(_is_flat(chunk) for table in tables for chunk in table.column(index).chunks)
        sinks.append(_Fixed(field.type, rows, width) if flat and width is not None else _Chunks(pool))
    while tables:
        _take(tables.pop(0), sinks)
    return pa.Table.from_arrays([sink.finish() for sink in sinks], schema=schema)


def _take(table: pa.Table, sinks: list[_Fixed | _Chunks]) -> None:
    """Hand each column of ``table`` to its sink (a function of its own: no loop variable keeps a
    column of the unit alive once it returns)."""
    for sink, column in zip(sinks, table.columns):
        for chunk in column.chunks:
            sink.put(chunk)


class _Fixed:
    """One column of fixed-size values, copied chunk by chunk into a buffer of all its rows."""

    def __init__(self, arrow_type: pa.DataType, rows: int, width: int) -> None:
        self.type, self.rows = arrow_type, rows
        # An anonymous mapping of its own (unmapped once the shard is written), faulted in 2 MiB pages
        self.bytes = np.frombuffer(blank_image(rows * width), np.uint8)[: rows * width]
        self.filled = 0

    def put(self, chunk: pa.Array) -> None:
        data = _values(chunk)
        self.bytes[self.filled : self.filled + len(data)] = data
        self.filled += len(data)

    def finish(self) -> pa.Array:
        return _rebuild(self.type, self.rows, pa.py_buffer(self.bytes))


class _Chunks:
    """Any other column: its chunks kept, concatenated at the end."""

    def __init__(self, pool: pa.MemoryPool) -> None:
        self.pool = pool
        self.chunks: list[pa.Array] = []

    def put(self, chunk: pa.Array) -> None:
        self.chunks.append(chunk)

    def finish(self) -> pa.Array:
        return pa.concat_arrays(self.chunks, memory_pool=self.pool)


def _row_bytes(arrow_type: pa.DataType) -> int | None:
    """Bytes per row of a type whose values lie in one buffer, or None (variable size, booleans)."""
    if isinstance(arrow_type, pa.ExtensionType):
        return _row_bytes(arrow_type.storage_type)
    if pa.types.is_fixed_size_binary(arrow_type):
        return int(arrow_type.byte_width)
    if pa.types.is_fixed_size_list(arrow_type):
        inner = _row_bytes(arrow_type.value_type)
        return None if inner is None else inner * arrow_type.list_size
    if (pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)) and arrow_type.bit_width % 8 == 0:
        return int(arrow_type.bit_width // 8)
    return None


def _is_flat(chunk: pa.Array) -> bool:
    """Whether ``chunk``'s values lie in one buffer (see :func:`_row_bytes`), with no null in it or a child."""
    if _row_bytes(chunk.type) is None or chunk.null_count:
        return False
    if isinstance(chunk, pa.ExtensionArray):
        return _is_flat(chunk.storage)
    if isinstance(chunk, pa.FixedSizeListArray):
        return _is_flat(chunk.flatten())
    return True


def _values(chunk: pa.Array) -> np.ndarray:
    """The bytes of a flat chunk's values (:func:`_is_flat`), in one run, without a copy."""
    if isinstance(chunk, pa.ExtensionArray):
        return _values(chunk.storage)
    if isinstance(chunk, pa.FixedSizeListArray):
        return _values(chunk.flatten())  # the child's values of exactly these rows (offset applied)
    width = chunk.type.byte_width if pa.types.is_fixed_size_binary(chunk.type) else chunk.type.bit_width // 8
    data = chunk.buffers()[1]
    if data is None:  # an empty array may have no buffer
        return np.empty(0, np.uint8)
    start = chunk.offset * width
    return np.frombuffer(data, np.uint8)[start : start + len(chunk) * width]


def _rebuild(arrow_type: pa.DataType, rows: int, buffer: pa.Buffer) -> pa.Array:
    """An array of ``rows`` values of ``arrow_type`` (see :func:`_row_bytes`) over ``buffer``, no nulls."""
    if isinstance(arrow_type, pa.ExtensionType):
        return pa.ExtensionArray.from_storage(arrow_type, _rebuild(arrow_type.storage_type, rows, buffer))
    if pa.types.is_fixed_size_list(arrow_type):
        child = _rebuild(arrow_type.value_type, rows * arrow_type.list_size, buffer)
        return pa.Array.from_buffers(arrow_type, rows, [None], children=[child])
    return pa.Array.from_buffers(arrow_type, rows, [None, buffer])
