"""Writing a remote in the layouts the daemon reads fastest, for users and for ``epochcache demo``.

A tensor per sample (an image, say) is best stored as a **fixed-size binary** column whose field
metadata carries its ``shape`` (and ``dtype``, default uint8): Parquet stores those bytes as they
are (one memcpy to decode), and the daemon turns the column into Arrow's fixed-shape tensor type
without a copy (:func:`epochcache.cache.columns.shaped`), so batches hold tensors of
``(batch, *shape)``. Arrow IPC files (one record batch per unit) need no decoding at all.

Flow: a numpy array ``(rows, *shape)`` -> :func:`tensor_column` -> a table -> :func:`write_parquet`
(or :func:`write_arrow`) -> files the daemon reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from epochcache.arrays import NUMBER_KINDS, numbers
from epochcache.cache.columns import DTYPE_KEY, SHAPE_KEY


def tensor_field(name: str, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> pa.Field:
    """A fixed-size binary field holding one ``shape`` tensor of ``dtype`` per row, its shape in its metadata."""
    dtype = np.dtype(dtype)
    metadata = {SHAPE_KEY: json.dumps(list(shape)).encode(), DTYPE_KEY: dtype.name.encode()}
    return pa.field(name, pa.binary(int(np.prod(shape)) * dtype.itemsize), nullable=False, metadata=metadata)


def tensor_column(items: np.ndarray) -> pa.Array:
    """``items`` (``(rows, *shape)``, C-contiguous or made so) as a fixed-size binary array over the
    same bytes; pair it with :func:`tensor_field` for its field."""
    items = np.ascontiguousarray(items)
    width = items[0].nbytes if len(items) else items.dtype.itemsize * int(np.prod(items.shape[1:]))
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(items), [None, pa.py_buffer(items)])


def tensor_table(columns: dict[str, np.ndarray]) -> pa.Table:
    """A table of ``columns``: arrays of 2+ dimensions become tensor columns (:func:`tensor_column`),
    1-dimensional ones plain number columns."""
    fields, arrays = [], []
    for name, values in columns.items():
        if values.ndim > 1:
            fields.append(tensor_field(name, values.shape[1:], values.dtype))
            arrays.append(tensor_column(values))
        else:
            fields.append(pa.field(name, pa.from_numpy_dtype(values.dtype), nullable=False))
            # (numbers from their buffers; strings and the like by pyarrow: this runs where a remote is written)
            arrays.append(numbers(values) if values.dtype.kind in NUMBER_KINDS + "b" else pa.array(values))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def write_parquet(table: pa.Table, path: str | Path, rows_per_group: int) -> None:
    """Write ``table`` as Parquet the fast way: no dictionary for binary columns (it would cost a
    hash per value to write and a lookup per value to decode, for noise-like tensors that never
    repeat), no compression (it would cost CPU on every read for incompressible data), and page
    checksums (so the daemon checks every page it reads)."""
    binary = [f.name for f in table.schema if pa.types.is_fixed_size_binary(f.type) or pa.types.is_binary(f.type)]
    pq.write_table(table, str(path), row_group_size=rows_per_group, compression="none",
                   use_dictionary=[f.name for f in table.schema if f.name not in binary],
                   write_page_checksum=True)


def write_arrow(table: pa.Table, path: str | Path, rows_per_batch: int) -> None:
    """Write ``table`` as an uncompressed Arrow IPC file of ``rows_per_batch``-row record batches
    (each batch is a unit the daemon reads with one GET, and uses as it is)."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=rows_per_batch)
