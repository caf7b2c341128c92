"""One rank of the distributed test (started by torchrun): DDP training on an EpochCachedLoader.

argv: the node's cache dir, the output dir, epochs. Writes ``rank<R>.json``: per epoch the batch
count, the sample ids seen and the snapshot id. DDP's gradient all-reduce on every batch makes an
unequal batch count a hang, which the test's timeout turns into a failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from epochcache import EpochCachedLoader


def main(cache_dir: str, out_dir: str, epochs: int) -> None:
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(3 * 16 * 16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    record = []
    with EpochCachedLoader(cache_dir, batch_size=16, progress=False) as loader:
        for _ in range(epochs):
            ids: list[int] = []
            for batch in loader:
                loss = model(batch["image"].float().flatten(1)).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                ids.extend(batch["id"].tolist())
            info = loader.last_epoch
            record.append({"epoch": info.epoch, "batches": info.batches, "ids": ids, "snapshot": info.snapshot})
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
