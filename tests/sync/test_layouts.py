"""The recommended layouts, end to end: a remote written by :mod:`epochcache.sources.layouts` (a
fixed-size binary image with its shape in the field metadata, as Parquet and as Arrow IPC), cached by
``sync --once``, yields batches of shaped uint8 tensors holding the remote's bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from epochcache import EpochCachedLoader, SyncDaemon
from epochcache.config import Config
from epochcache.sources.layouts import tensor_table, write_arrow, write_parquet

SHAPE = (3, 4, 4)
FILES, ROWS_PER_FILE, ROWS_PER_UNIT = 3, 40, 16


def _images(ids: np.ndarray) -> np.ndarray:
    """Each sample's image: its id in the first pixel, then a pattern that differs per position."""
    images = (np.arange(np.prod(SHAPE), dtype=np.uint64)[None, :] * 7 + ids[:, None]) % 251
    return images.astype(np.uint8).reshape(len(ids), *SHAPE)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_fixed_size_binary_with_a_shape_is_trained_on_as_shaped_tensors(
    fmt: str, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    for number in range(FILES):
        ids = np.arange(number * ROWS_PER_FILE, (number + 1) * ROWS_PER_FILE)
        table = tensor_table({"image": _images(ids), "id": ids})
        if fmt == "parquet":
            write_parquet(table, remote / f"part-{number}.parquet", ROWS_PER_UNIT)
        else:
            write_arrow(table, remote / f"part-{number}.arrow", ROWS_PER_UNIT)
    if fmt == "parquet":  # the layout's promise: the bytes stored as they are, with page checksums
        column = pq.ParquetFile(remote / "part-0.parquet").metadata.row_group(0).column(0)
        assert column.physical_type == "FIXED_LEN_BYTE_ARRAY" and column.compression == "UNCOMPRESSED"
        assert "PLAIN" in column.encodings and not column.has_dictionary_page
    config = make_config(str(remote), **{"source.format": fmt, "cache.max_bytes": "10MB",
                                         "cache.shard_bytes": "64KiB"})
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.samples_published == FILES * ROWS_PER_FILE

    seen = []
    with EpochCachedLoader(config.cache.dir, batch_size=25, wait_timeout_s=10) as loader:
        for batch in loader:
            images, ids = batch["image"], batch["id"]
            assert images.dtype == torch.uint8 and tuple(images.shape) == (len(ids), *SHAPE)
            np.testing.assert_array_equal(images.numpy(), _images(ids.numpy()))
            seen.extend(ids.tolist())
    assert sorted(seen) == list(range(FILES * ROWS_PER_FILE))


def test_one_dimensional_columns_of_any_dtype_keep_their_values() -> None:
    flags = np.array([True, False, True, True])
    names = np.array(["a", "bb", "", "ccc"])
    ids = np.arange(4, dtype=">i8")  # (big-endian: converted, not reinterpreted)
    table = tensor_table({"flag": flags, "name": names, "id": ids})
    assert table.column("flag").to_pylist() == flags.tolist()
    assert table.column("name").to_pylist() == names.tolist()
    assert table.column("id").to_pylist() == [0, 1, 2, 3]
