"""What each Arrow column type becomes in a batch, decided by its type alone (no torch here, so the
daemon can apply the same rules when it writes rows, and the loader when it reads them).

- fixed-width (numbers, fixed-size lists of them, the fixed-shape tensor type): a tensor of shape
  ``(batch, *item_shape)``, which cannot hold a null;
- string (utf8, large_utf8): a list of Python ``str`` (None for a null);
- binary: a list of zero-copy buffers (None for a null);
- anything else: a pyarrow array.
"""

from __future__ import annotations

import pyarrow as pa


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
