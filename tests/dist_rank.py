"""One rank of a distributed loader test, started by ``tests/train/dist_launch.py`` (or torchrun).

argv: a JSON plan file, the output dir. The plan: ``caches`` (a cache dir per node, by GROUP_RANK),
``loader`` (EpochCachedLoader keyword arguments), ``epochs``, and optionally ``timeout_s``
(init_process_group's), ``transform`` (a per-batch transform, so worker processes build batches),
``late_s`` (seconds a rank waits before building its loader, by rank), ``kill_at`` (``[rank, epoch,
batch]``: that rank SIGKILLs itself after taking that batch; ``[rank, -1, 0]``: before building its
loader), ``stop_after`` (batches of epoch 0 after which every rank saves its ``state_dict`` and
stops), ``leave_after`` (batches after which every rank leaves each epoch), ``loader_by_rank`` (a
rank's own loader arguments), ``quarantine_at`` (``[rank, epoch, batch]``: that rank quarantines its
cache's first shard after taking that batch, once the next epoch is prepared), ``resume`` (a dir of
saved states: each rank loads its own). No DDP model: the loader's own collectives are under test,
and a rank with fewer batches shows in the counts. Writes ``rank<R>.json``: per epoch the batches'
ids, the batch count, the snapshot and whether it was prepared ahead, the seconds the loader ran,
and ``error`` if it raised.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from epochcache import EpochCachedLoader, Ledger
from epochcache.cache.layout import CacheLayout
from epochcache.cache.quarantine import quarantine_shard


def add_one(batch: dict[str, Any]) -> dict[str, Any]:
    """A transform that a worker process runs: ids are passed through, images touched."""
    return {"id": batch["id"], "image": batch["image"].float() + 1}


def quarantine_one(cache: str, loader: EpochCachedLoader) -> None:
    """Quarantine the cache's first shard, as the verifier does with a damaged one, once ``loader`` has
    built its next epoch ahead (white-box: the turnover's future), so that epoch holds the shard."""
    deadline = time.monotonic() + 30
    while not (loader._turnover.next is not None and loader._turnover.next[1].done()):
        if time.monotonic() > deadline:
            raise TimeoutError("the next epoch was not prepared ahead within 30 s")
        time.sleep(0.01)
    layout = CacheLayout(Path(cache))
    ledger = Ledger(layout.ledger)
    try:
        quarantine_shard(layout, ledger, ledger.shards()[0], "quarantined by the test")
    finally:
        ledger.close()


def main(plan_path: str, out_dir: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=plan.get("timeout_s", 60)))
    rank = dist.get_rank()
    time.sleep(plan.get("late_s", {}).get(str(rank), 0))
    if plan.get("kill_at") == [rank, -1, 0]:  # dies before building its loader
        os.kill(os.getpid(), signal.SIGKILL)
    cache = plan["caches"][os.environ.get("GROUP_RANK", "0")]
    transform = add_one if plan.get("transform") else None
    record: dict[str, Any] = {"epochs": []}
    started = time.monotonic()
    try:
        settings = {**plan["loader"], **plan.get("loader_by_rank", {}).get(str(rank), {})}
        with EpochCachedLoader(cache, transform=transform, progress=False, **settings) as loader:
            if plan.get("resume"):
                loader.load_state_dict(torch.load(Path(plan["resume"], f"state{rank}.pt")))
            for epoch in range(plan["epochs"]):
                batches: list[list[int]] = []
                for batch in loader:
                    batches.append(batch["id"].tolist())
                    if plan.get("kill_at") == [rank, epoch, len(batches)]:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if plan.get("quarantine_at") == [rank, epoch, len(batches)]:
                        quarantine_one(cache, loader)
                    if plan.get("leave_after") == len(batches):
                        break
                    if plan.get("stop_after") == len(batches) and epoch == 0:
                        torch.save(loader.state_dict(), Path(out_dir, f"state{rank}.pt"))
                        break
                info = loader.last_epoch
                record["epochs"].append({"epoch": info.epoch, "batches": info.batches, "ids": batches,
                                         "snapshot": info.snapshot, "samples": info.samples,
                                         "ahead": info.prepared_ahead})
                if plan.get("stop_after"):
                    break
    except Exception as exc:  # the test reads what each surviving rank saw, and how soon
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["seconds"] = time.monotonic() - started
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
