"""Arrow arrays from numpy arrays and Python values, and numpy views of Arrow arrays, made from their
buffers rather than by pyarrow's conversions (``pa.array``, ``pa.scalar``, ``Array.to_numpy``).

Where pandas is installed (most Python environments that train models), pyarrow imports it at the
first of those conversions in a process, to ask whether the value is a pandas object: 147 ms and
56 MB of resident memory (pandas 3.1, pyarrow 26), paid by the daemon at its first unit and by the
trainer and each worker process on the way to a first batch. Nothing else of epochcache imports
pandas. Invariant: each function gives the values pyarrow's conversion gives, and a view shares the
array's memory (a shard's mapping: no copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

# The most bytes a binary or string array holds (its offsets are int32); pa.array splits there too.
MAX_ARRAY_BYTES = 2**31 - 1


# numpy dtype kinds whose values Arrow stores as numpy does, one fixed-width slot each: integers,
# floats, datetimes and durations (bools are packed to bits: :func:`flags`).
NUMBER_KINDS = "iufMm"


def numbers(values: np.ndarray) -> pa.Array:
    """1-D numbers (or bools, by :func:`flags`) as the Arrow array of their type, sharing their
    memory (copied once if they are not contiguous or not in native byte order); TypeError for
    other dtypes (strings, objects), naming the dtype."""
    if values.dtype == np.bool_:
        return flags(values)
    if values.dtype.kind not in NUMBER_KINDS:
        raise TypeError(f"numbers() takes integers, floats, datetimes or bools, not {values.dtype}")
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("="))
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def flags(values: np.ndarray) -> pa.Array:
    """1-D bools as an Arrow boolean array (packed to bits, as Arrow stores them: a copy of an eighth)."""
    return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(np.packbits(values, bitorder="little"))])


def binaries(values: Sequence[bytes | memoryview | None], kind: pa.DataType | None = None,
             max_bytes: int = MAX_ARRAY_BYTES) -> pa.Array | pa.ChunkedArray:
    """Byte strings (None: null) as an Arrow ``kind`` array (binary by default; ``pa.string()`` for
    UTF-8 text already encoded): one copy of the bytes. Over ``max_bytes`` of them, a chunked array
    of arrays that each hold at most that, as ``pa.array`` gives; ValueError for one value over it."""
    kind = kind or pa.binary()
    lengths = np.fromiter((0 if v is None else len(v) if isinstance(v, bytes) else memoryview(v).nbytes
                           for v in values), np.int64, len(values))
    ends = np.cumsum(lengths)
    chunks: list[pa.Array] = []
    start = 0
    while start < len(values) or not chunks:
        base = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, base + max_bytes, side="right"))
        if stop == start < len(values):
            raise ValueError(f"a value of {lengths[start]} bytes: over the {max_bytes} an Arrow {kind} array holds")
        chunks.append(_binary_array(values[start:stop], ends[start:stop] - base, kind))
        start = stop
    return chunks[0] if len(chunks) == 1 else pa.chunked_array(chunks, kind)


def _binary_array(values: Sequence[bytes | memoryview | None], ends: np.ndarray, kind: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(values) + 1, np.int32)
    offsets[1:] = ends
    valid = None
    if any(v is None for v in values):
        valid = pa.py_buffer(np.packbits([v is not None for v in values], bitorder="little"))
    data = pa.py_buffer(b"".join(v for v in values if v is not None))
    return pa.Array.from_buffers(kind, len(values), [valid, pa.py_buffer(offsets), data])


def texts(values: Sequence[str]) -> pa.Array:
    """Python strings as an Arrow string array."""
    return binaries([v.encode() for v in values], pa.string())


def text(value: str) -> pa.Scalar:
    """A Python string as an Arrow string scalar (for compute functions, which convert ``str`` by ``pa.scalar``)."""
    return texts([value])[0]


def numpy_view(array: pa.Array) -> np.ndarray:
    """A zero-copy ``(rows, *item_shape)`` numpy view (read-only over a mapping) of a column without
    nulls of numbers, fixed-size lists of them, or the fixed-shape tensor type. Walks down to the
    numbers by ``values`` and offsets (``flatten()`` costs 23 ms at its first call in a process)."""
    item_shape = None
    if isinstance(array.type, pa.FixedShapeTensorType):
        if array.type.permutation not in (None, list(range(len(array.type.shape)))):
            return np.ascontiguousarray(array.to_numpy_ndarray())  # (a layout to permute: copied)
        item_shape = list(array.type.shape)
        array = array.storage
    shape = [len(array)]
    start, count = array.offset, len(array)  # the rows, as slots of the array's buffers
    while True:
        # (a null list inside a row, or a null number, has bytes under it all the same: never data)
        nulls = array.slice(start - array.offset, count).null_count
        if nulls:
            raise ValueError(f"a fixed-width column holds {nulls} null items or numbers: a tensor cannot")
        if not pa.types.is_fixed_size_list(array.type):
            break
        size = array.type.list_size
        shape.append(size)
        array = array.values
        start, count = array.offset + start * size, count * size
    dtype = _numpy_dtype(array.type)
    if not count:
        return np.empty(shape if item_shape is None else [0, *item_shape], dtype)
    flat = np.frombuffer(array.buffers()[1], dtype, count, start * dtype.itemsize)
    return flat.reshape(shape if item_shape is None else [shape[0], *item_shape])


def _numpy_dtype(kind: pa.DataType) -> np.dtype:
    """The numpy dtype of an Arrow integer or floating-point type (``to_pandas_dtype()`` imports pandas
    in pyarrow 25, and fails where pandas is missing)."""
    if pa.types.is_floating(kind):
        return np.dtype(f"float{kind.bit_width}")
    return np.dtype(f"{'uint' if pa.types.is_unsigned_integer(kind) else 'int'}{kind.bit_width}")


def unpacked(array: pa.BooleanArray) -> np.ndarray:
    """A boolean array without nulls as a numpy bool array (a copy: Arrow packs bools to bits)."""
    bits = np.unpackbits(np.frombuffer(array.buffers()[1], np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(bool)
