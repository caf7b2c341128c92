"""Mappings benchmark: gather throughput over a cache of few shards against caches of many shards
holding the same bytes, with the loader's bounded set of open mappings (``max_open_shards``).

The data: ``--size`` bytes of 12 KB samples (a 3x64x64 uint8 image and an int64 label) written as
shard files straight by :func:`epochcache.cache.shards.write_shard` (no daemon, no ledger: this measures
the mapping and gather path alone). Each layout is read as shuffled batches of ``--batch`` samples
for ``--epochs`` epochs; the rate is the median of the warm epochs (the first maps and faults in).

Each layout is read in the loader's order ("loader": windows of ``max_open // 2`` shards once an epoch
spans more shards than that) and in a plain permutation of every sample ("plain"); the base is the
first layout in the loader's order.

    python benchmarks/mappings.py [--size 256MB] [--shards 16,1000,4000] [--max-open 1024] [--epochs 3] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from pydantic import ByteSize, TypeAdapter

from epochcache.cache.shards import write_shard
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.mappings import ShardMaps
from epochcache.train.order import epoch_order

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


def epoch_rates(paths: list[Path], rows: list[int], max_open: int, batch: int, epochs: int,
                windowed: bool) -> list[float]:
    """Samples per second of each epoch over one dataset (its mappings kept across epochs, as the loader
    does), in the loader's order (``windowed``: shuffled by windows of ``max_open // 2`` shards once the
    epoch spans more) or in a plain permutation of all samples."""
    dataset = ShardSetDataset(paths, rows, maps=ShardMaps(max_open))
    rates = []
    for epoch in range(epochs):
        order = epoch_order(len(dataset), 0, epoch, True, shard_rows=rows if windowed else None,
                            window=max(1, max_open // 2))
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
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "mappings.json")
    args = parser.parse_args()
    rows = TypeAdapter(ByteSize).validate_python(args.size) // SAMPLE_BYTES
    counts = [int(c) for c in args.shards.split(",")]
    print(f"{rows} samples of {SAMPLE_BYTES} B, batch {args.batch}, max_open_shards {args.max_open}")
    print(f"{'shards':>8} {'samples/shard':>14} {'order':>9} {'samples/s':>11} {'MB/s':>8} {'vs base':>8}")
    base, results = None, []
    with tempfile.TemporaryDirectory() as tmp:
        for shards in counts:
            paths, per_shard = write_shards(Path(tmp) / str(shards), rows, shards)
            for windowed in (True, False):
                rates = epoch_rates(paths, per_shard, args.max_open, args.batch, args.epochs, windowed)
                rate = statistics.median(rates[1:])
                base = base or rate
                order = "loader" if windowed else "plain"
                print(f"{shards:>8} {rows / shards:>14.1f} {order:>9} {rate:>11.0f} "
                      f"{rate * SAMPLE_BYTES / 1e6:>8.0f} {rate / base:>8.2f}")
                results.append({"shards": shards, "order": order, "samples_per_s": rate, "vs_base": rate / base})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"samples": rows, "batch": args.batch, "max_open_shards": args.max_open,
                                    "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
