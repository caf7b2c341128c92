"""The peer benchmark's samples (``peers.py``), the batch every system must deliver, and each system's
way of storing them.

Sample ``i`` is ``size`` random bytes stamped with ``i`` in its first 8 bytes, label ``i`` (int64).
Every system's batch is ``{"image": uint8 tensor (rows, size), "label": int64 tensor (rows,)}``, built
from raw bytes by one packing function (``pack_images``): the peers' collate, and epochcache's transform
for its byte-column layout. The writers put the samples in each system's format under a local folder
(``peers.py`` uploads it); the heavy imports are inside them, so a child imports only its own system.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np

BUCKET = "bench"
KEY = SECRET = "bench"  # the loopback moto server's (any credentials are accepted)
PACKAGES = {"epochcache": "epochcache", "litdata": "litdata", "webdataset": "webdataset", "streaming": "streaming"}
SEED = 0
ROWS_PER_RECORD_BATCH = 512
Batch = dict[str, Any]


def sample(index: int, size: int) -> bytes:
    """Sample ``index``: ``size`` random bytes (the same on every call), the first 8 its index."""
    payload = np.random.default_rng([SEED, index]).integers(0, 256, size, dtype=np.uint8)
    payload[:8] = np.frombuffer(np.int64(index).tobytes(), np.uint8)
    return payload.tobytes()


def pack_images(images: Sequence[Any]) -> Any:
    """Raw byte strings (bytes or any buffer) -> one uint8 tensor ``(len(images), size)``: one copy."""
    import torch

    rows = np.concatenate([np.frombuffer(image, np.uint8) for image in images])
    return torch.from_numpy(rows.reshape(len(images), -1))


def collate(samples: list[dict[str, Any]]) -> Batch:
    """The peers' collate: per-sample ``{"image": bytes, "label": int}`` -> the batch every system yields."""
    import torch

    return {
        "image": pack_images([s["image"] for s in samples]),
        "label": torch.tensor([int(s["label"]) for s in samples], dtype=torch.int64),
    }


def bytes_to_tensor(batch: Batch) -> Batch:
    """epochcache's transform for the "bytes" rows: its zero-copy buffers through the same packing."""
    return {"image": pack_images(batch["image"]), "label": batch["label"]}



def write_dataset(prefix: str, local: Path, args: argparse.Namespace) -> None:
    """The samples in ``prefix``'s format under the local folder ``local`` (uploaded afterwards)."""
    local.mkdir(parents=True)
    WRITERS[prefix.split("-")[0]](prefix, local, args)


def write_epochcache(prefix: str, local: Path, args: argparse.Namespace) -> None:
    """Arrow IPC files of about ``shard_mb`` each, record batches of 512 rows (the daemon's units)."""
    import pyarrow as pa

    kind = pa.binary() if prefix.endswith("bytes") else pa.list_(pa.uint8(), args.size)
    schema = pa.schema([("image", kind), ("label", pa.int64())])
    per_file = max(ROWS_PER_RECORD_BATCH, args.shard_mb * 2**20 // args.size)
    for number, first in enumerate(range(0, args.count, per_file)):
        with pa.ipc.new_file(str(local / f"part-{number:04d}.arrow"), schema) as writer:
            for start in range(first, min(first + per_file, args.count), ROWS_PER_RECORD_BATCH):
                indices = range(start, min(start + ROWS_PER_RECORD_BATCH, first + per_file, args.count))
                writer.write_batch(record_batch(indices, kind, schema, args.size))


def record_batch(indices: range, kind: Any, schema: Any, size: int) -> Any:
    import pyarrow as pa

    data = pa.py_buffer(b"".join(sample(i, size) for i in indices))
    if pa.types.is_binary(kind):
        offsets = pa.py_buffer(np.arange(0, (len(indices) + 1) * size, size, dtype=np.int32).tobytes())
        images = pa.Array.from_buffers(kind, len(indices), [None, offsets, data])
    else:
        images = pa.FixedSizeListArray.from_arrays(pa.Array.from_buffers(pa.uint8(), len(data), [None, data]), size)
    labels = pa.array(np.asarray(indices, dtype=np.int64))
    return pa.record_batch([images, labels], schema=schema)


def _litdata_item(index_and_size: tuple[int, int]) -> dict[str, Any]:
    index, size = index_and_size
    return {"image": sample(index, size), "label": index}


def write_litdata(_: str, local: Path, args: argparse.Namespace) -> None:
    """``litdata.optimize`` chunks of ``shard_mb``; ``image`` is stored with LitData's bytes serializer."""
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=[(i, args.size) for i in range(args.count)], output_dir=str(local),
                     chunk_bytes=args.shard_mb * 2**20, num_workers=1, verbose=False)


def write_webdataset(_: str, local: Path, args: argparse.Namespace) -> None:
    """Tar shards of ``shard_mb``, members ``<key>.bin`` (the bytes) and ``<key>.cls`` (the label)."""
    import webdataset as wds

    with wds.ShardWriter(str(local / "shard-%06d.tar"), maxsize=args.shard_mb * 2**20, maxcount=10**9,
                         verbose=0) as sink:
        for i in range(args.count):
            sink.write({"__key__": f"{i:08d}", "bin": sample(i, args.size), "cls": i})


def write_streaming(_: str, local: Path, args: argparse.Namespace) -> None:
    """MDS shards of ``shard_mb``, uncompressed, columns ``image: bytes`` and ``label: int64``."""
    MDSWriter = import_streaming().MDSWriter

    with MDSWriter(out=str(local), columns={"image": "bytes", "label": "int64"},
                   size_limit=args.shard_mb * 2**20) as writer:
        for i in range(args.count):
            writer.write({"image": sample(i, args.size), "label": i})


WRITERS: dict[str, Callable[[str, Path, argparse.Namespace], None]] = {
    "epochcache": write_epochcache, "litdata": write_litdata, "webdataset": write_webdataset,
    "streaming": write_streaming,
}


def import_streaming() -> Any:
    """``streaming``, imported after :func:`_torchvision` has made sure its torchvision import succeeds."""
    _torchvision()
    return importlib.import_module("streaming")


def _torchvision() -> None:
    """mosaicml-streaming's ``__init__`` imports torchvision for its image datasets, which this benchmark
    does not use. Where no torchvision loads (no CPU build of it matching the installed torch), a stand-in
    module with the two names it imports takes its place; a torchvision that loads is used as it is."""
    import types

    try:
        importlib.import_module("torchvision")
        return
    except (ImportError, RuntimeError):  # absent, or a build for another torch: its operators fail to register
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    import torch.utils.data

    stand_in: dict[str, dict[str, Any]] = {
        "torchvision": {}, "torchvision.datasets": {"VisionDataset": torch.utils.data.Dataset},
        "torchvision.transforms": {}, "torchvision.transforms.functional": {"to_tensor": None},
    }
    for name, attributes in stand_in.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() reads it
        sys.modules[name] = module
