"""What each Arrow column type becomes in a batch, decided by its type alone (no torch here, so the
daemon can apply the same rules when it writes rows, and the loader when it reads them).

- fixed-width (numbers, fixed-size lists of them, the fixed-shape tensor type): a tensor of shape
  ``(batch, *item_shape)``, which cannot hold a null;
- string (utf8, large_utf8): a list of Python ``str`` (None for a null);
- binary: a list of zero-copy buffers (None for a null);
- anything else: a pyarrow array.

A tensor's shape can also come from the remote's field metadata (:func:`shaped`): a fixed-size
binary column, or a fixed-size list of numbers, whose field carries ``shape`` (a JSON list of ints,
e.g. ``"[3, 64, 64]"``; and for binary optionally ``dtype``, a numpy type name, default ``uint8``)
is turned by the daemon into the fixed-shape tensor type, zero-copy, before its rows reach a shard.
That is the fast layout for Parquet, which stores a fixed-shape tensor of uint8 as INT32 (4x the
bytes) unless dictionary-encoded (then slow to decode), but a fixed-size binary as the bytes themselves.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa

from epochcache.errors import SourceError

SHAPE_KEY = b"shape"
DTYPE_KEY = b"dtype"


def is_fixed_width(arrow_type: pa.DataType) -> bool:
    """Numbers, fixed-size lists of them, or the fixed-shape tensor type: the columns that become tensors."""
    if isinstance(arrow_type, pa.FixedShapeTensorType):
        return True
    while pa.types.is_fixed_size_list(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)


def is_binary(arrow_type: pa.DataType) -> bool:
    """Variable-size binary: the columns that become lists of zero-copy buffers."""
    return bool(pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type))


def is_string(arrow_type: pa.DataType) -> bool:
    """String (utf8 or large_utf8): the columns that become lists of ``str``."""
    return bool(pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type))


def shaped(table: pa.Table) -> pa.Table:
    """``table`` with every column whose field metadata names a ``shape`` as a fixed-shape tensor
    column of that item shape (the buffers are reinterpreted, never copied); other columns, and the
    table itself when no field has a shape, are returned as they are. Raises :class:`SourceError`
    when a shape does not fit its column's type (naming the column, the shape and the type)."""
    fields = list(table.schema)
    if not any(SHAPE_KEY in (field.metadata or {}) for field in fields):
        return table
    columns = []
    for index, field in enumerate(fields):
        column = table.column(index)
        if SHAPE_KEY in (field.metadata or {}):
            tensor_type = _tensor_type(field)
            field = pa.field(field.name, tensor_type, field.nullable, field.metadata)
            column = pa.chunked_array([_as_tensor(chunk, tensor_type) for chunk in column.chunks], tensor_type)
        columns.append(column)
        fields[index] = field
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, table.schema.metadata))


def _tensor_type(field: pa.Field) -> pa.FixedShapeTensorType:
    """The fixed-shape tensor type ``field``'s metadata asks for; :class:`SourceError` if it cannot hold it."""
    meta = field.metadata or {}
    fix = (f"fix the field metadata of column {field.name!r} in the remote ({SHAPE_KEY.decode()}: a JSON list "
           f"of positive ints whose product is the item count; {DTYPE_KEY.decode()}: a numpy number type)")
    try:
        shape = json.loads(meta[SHAPE_KEY])
        if not isinstance(shape, list) or not all(isinstance(n, int) and n > 0 for n in shape) or not shape:
            raise ValueError(f"not a list of positive ints: {shape!r}")
        dtype = np.dtype(meta.get(DTYPE_KEY, b"uint8").decode())
        value_type = pa.from_numpy_dtype(dtype)
    except (ValueError, TypeError, pa.ArrowNotImplementedError) as exc:
        raise SourceError(f"column {field.name!r} has shape metadata {meta.get(SHAPE_KEY)!r} and dtype "
                          f"{meta.get(DTYPE_KEY)!r} that are not a tensor's ({exc}): {fix}") from exc
    kind = field.type
    if pa.types.is_fixed_size_binary(kind) and is_fixed_width(value_type):
        fits = math.prod(shape) * dtype.itemsize == kind.byte_width
    elif pa.types.is_fixed_size_list(kind) and is_fixed_width(kind.value_type) \
            and not pa.types.is_fixed_size_list(kind.value_type):
        value_type = kind.value_type  # a list's items have their type already: dtype is not needed
        fits = math.prod(shape) == kind.list_size
    else:
        raise SourceError(f"column {field.name!r} has shape metadata {shape} but type {kind}: a shape applies to "
                          f"a fixed-size binary or a fixed-size list of numbers; {fix}")
    if not fits:
        raise SourceError(f"column {field.name!r} has shape metadata {shape} ({math.prod(shape)} items of "
                          f"{value_type}) that does not fill its type {kind}: {fix}")
    return pa.fixed_shape_tensor(value_type, shape)


def _as_tensor(chunk: pa.Array, tensor_type: pa.FixedShapeTensorType) -> pa.ExtensionArray:
    """``chunk`` (fixed-size binary or list) as a ``tensor_type`` array over the same buffers."""
    storage_type = tensor_type.storage_type
    if pa.types.is_fixed_size_binary(chunk.type):
        validity, data = chunk.buffers()
        items = storage_type.list_size
        values = pa.Array.from_buffers(storage_type.value_type, (chunk.offset + len(chunk)) * items, [None, data])
        chunk = pa.Array.from_buffers(storage_type, chunk.offset + len(chunk), [validity], children=[values]
                                      ).slice(chunk.offset, len(chunk))
    return pa.ExtensionArray.from_storage(tensor_type, chunk)
