"""Mappings benchmark: gather throughput over a cache of few shards against caches of many shards
holding the same bytes, with the loader's bounded set of open mappings (``max_open_shards``).

The data: ``--size`` bytes of 12 KB samples (a 3x64x64 uint8 image and an int64 label) written as
shard files straight by :func:`epochcache.shards.write_shard` (no daemon, no ledger: this measures
the mapping and gather path alone). Each layout is read as shuffled batches of ``--batch`` samples
for ``--epochs`` epochs; the rate is the median of the warm epochs (the first maps and faults in).

    python benchmarks/mappings.py [--size 256MB] [--shards 16,1000,4000] [--max-open 1024] [--epochs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from pydantic import ByteSize, TypeAdapter

from epochcache.dataset import ShardSetDataset
from epochcache.mappings import ShardMaps
from epochcache.shards import write_shard

SHAPE = (3, 64, 64)
SAMPLE_BYTES = int(np.prod(SHAPE)) + 8


def write_shards(folder: Path, rows: int, shards: int) -> tuple[list[Path], list[int]]:
    """``rows`` random samples split as evenly as can be into ``shards`` files."""
    folder.mkdir(parents=True)
    rng, paths, counts = np.random.default_rng(0), [], []
    for number, part in enumerate(np.array_split(np.arange(rows), shards)):
        images = rng.integers(0, 256, (len(part), *SHAPE), dtype=np.uint8)
        table = pa.table({"image": pa.FixedShapeTensorArray.from_numpy_ndarray(images), "label": pa.array(part)})
        path = folder / f"s{number:06d}.arrow"
        write_shard(table, folder / "tmp", path)
        paths.append(path)
        counts.append(len(part))
    return paths, counts


def epoch_rates(paths: list[Path], rows: list[int], max_open: int, batch: int, epochs: int) -> list[float]:
    """Samples per second of each epoch over one dataset (its mappings kept across epochs, as the loader does)."""
    dataset = ShardSetDataset(paths, rows, maps=ShardMaps(max_open))
    rates = []
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(dataset))
        started = time.perf_counter()
        for start in range(0, len(order), batch):
            dataset.__getitems__(order[start : start + batch])
        rates.append(len(order) / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="256MB")
    parser.add_argument("--shards", default="16,1000,4000", help="shard counts to compare; the first is the base")
    parser.add_argument("--max-open", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    rows = TypeAdapter(ByteSize).validate_python(args.size) // SAMPLE_BYTES
    counts = [int(c) for c in args.shards.split(",")]
    print(f"{rows} samples of {SAMPLE_BYTES} B, batch {args.batch}, max_open_shards {args.max_open}")
    print(f"{'shards':>8} {'samples/shard':>14} {'samples/s':>11} {'MB/s':>8} {'vs base':>8}")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for shards in counts:
            paths, per_shard = write_shards(Path(tmp) / str(shards), rows, shards)
            rate = statistics.median(epoch_rates(paths, per_shard, args.max_open, args.batch, args.epochs)[1:])
            base = base or rate
            print(f"{shards:>8} {rows / shards:>14.1f} {rate:>11.0f} {rate * SAMPLE_BYTES / 1e6:>8.0f} "
                  f"{rate / base:>8.2f}")


if __name__ == "__main__":
    main()
