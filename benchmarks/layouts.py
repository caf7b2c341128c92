"""Storage layouts for a tensor per sample: what each costs on the remote and to decode.

The same samples (a 3x64x64 uint8 image of noise and an int64 label, the demo's) are written in
each layout to local files; then every unit is read with the daemon's own source (``read``: ranged
reads of the file, page checksums checked where written, decode, the key column) and turned into
what a shard holds (:func:`epochcache.cache.columns.shaped`). Reported per sample: bytes on the
remote, and CPU µs of that read path (``time.process_time``, best of ``--repeats``), in one process.
No network is involved: the figures are the client CPU a layout costs, not a transfer rate.

Prints a table and writes ``benchmarks/results/layouts.json``. Usage: ``python benchmarks/layouts.py
[--samples 8192] [--rows-per-group 512] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from epochcache.cache.columns import shaped
from epochcache.sources import ArrowSource, ParquetSource
from epochcache.sources.layouts import tensor_table, write_arrow, write_parquet

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = (3, 64, 64)


Writer = Callable[[pa.Table, Path], None]
Builder = Callable[[np.ndarray, np.ndarray], pa.Table]


def tensor(images: np.ndarray, labels: np.ndarray) -> pa.Table:
    """The image as Arrow's fixed-shape tensor type."""
    return pa.table({"image": pa.FixedShapeTensorArray.from_numpy_ndarray(images), "label": labels})


def binary(images: np.ndarray, labels: np.ndarray) -> pa.Table:
    """The image as fixed-size binary with its shape in the field metadata (the recommended layout)."""
    return tensor_table({"image": images, "label": labels})


def layouts(group: int) -> dict[str, tuple[str, Builder, Writer]]:
    """Name -> (format, table builder, writer of a table to a path), ``group`` rows per unit."""
    return {
        "parquet fixed_shape_tensor, plain": ("parquet", tensor, lambda t, p: pq.write_table(
            t, p, row_group_size=group, compression="none", use_dictionary=False)),
        "parquet fixed_shape_tensor, pyarrow defaults": ("parquet", tensor, lambda t, p: pq.write_table(
            t, p, row_group_size=group)),
        "parquet fixed-size binary + shape (recommended)": ("parquet", binary, lambda t, p: write_parquet(
            t, p, group)),
        "parquet fixed-size binary + shape, snappy": ("parquet", binary, lambda t, p: pq.write_table(
            t, p, row_group_size=group, use_dictionary=["label"], write_page_checksum=True)),
        "arrow IPC fixed_shape_tensor": ("arrow", tensor, lambda t, p: write_arrow(t, p, group)),
        "arrow IPC fixed-size binary + shape": ("arrow", binary, lambda t, p: write_arrow(t, p, group)),
    }


def measure(kind: str, folder: Path, samples: int, repeats: int) -> tuple[float, int]:
    """CPU µs per sample of reading every unit under ``folder`` as the daemon does (best of
    ``repeats``), and the row count read (checked against ``samples``)."""
    best = float("inf")
    for _ in range(repeats):
        source = ParquetSource(str(folder)) if kind == "parquet" else ArrowSource(str(folder))
        start, rows = time.process_time(), 0
        for obj in source.list_objects():
            for unit in source.units(obj):
                table = shaped(source.read(unit))
                rows += table.num_rows
        best = min(best, time.process_time() - start)
        if rows != samples:
            raise RuntimeError(f"{folder}: read {rows} rows of {samples}")
        if table.schema.field("image").type != pa.fixed_shape_tensor(pa.uint8(), SHAPE):
            raise RuntimeError(f"{folder}: the image column was not read as a {SHAPE} tensor")
    return best / samples * 1e6, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--rows-per-group", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, args.samples)
    images = rng.integers(0, 128, (args.samples, *SHAPE), dtype=np.uint8) + (labels * 12).astype(np.uint8)[
        :, None, None, None]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for number, (name, (kind, build, write)) in enumerate(layouts(args.rows_per_group).items()):
            folder = Path(tmp) / str(number)
            folder.mkdir()
            suffix = ".parquet" if kind == "parquet" else ".arrow"
            files = 4
            for part, chunk in enumerate(np.array_split(np.arange(args.samples), files)):
                write(build(images[chunk], labels[chunk]), folder / f"part-{part}{suffix}")
            nbytes = sum(p.stat().st_size for p in folder.iterdir())
            cpu_us, _ = measure(kind, folder, args.samples, args.repeats)
            rows.append({"layout": name, "bytes_per_sample": round(nbytes / args.samples),
                         "bytes_vs_raw": round(nbytes / images.nbytes, 2), "cpu_us_per_sample": round(cpu_us, 1)})
    width = max(len(r["layout"]) for r in rows)
    print(f"{'layout':<{width}} | bytes/sample | x raw | read CPU µs/sample")
    print(f"{'-' * width}-|--------------|-------|-------------------")
    for r in rows:
        print(f"{r['layout']:<{width}} | {r['bytes_per_sample']:>12} | {r['bytes_vs_raw']:>5} | "
              f"{r['cpu_us_per_sample']:>18}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "layouts.json").write_text(json.dumps({"samples": args.samples, "shape": SHAPE, "rows": rows},
                                                     indent=2) + "\n")
    print(f"wrote {RESULTS / 'layouts.json'}")


if __name__ == "__main__":
    main()
