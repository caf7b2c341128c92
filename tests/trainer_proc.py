"""A training process for the multi-process tests: EpochCachedLoader epochs on one cache dir.

``python trainer_proc.py CACHE_DIR LEASE_TTL_S hold``: takes epoch 0, reads one batch, prints
``{"holding": true}`` and blocks on stdin (the test kills it). ``... N``: runs N epochs and prints
``{"epoch": e, "samples": n, "ids": distinct}`` per epoch.
"""

from __future__ import annotations

import json
import sys

from epochcache import EpochCachedLoader


def main(cache_dir: str, ttl: float, mode: str) -> None:
    with EpochCachedLoader(cache_dir, batch_size=64, lease_ttl_s=ttl, wait_timeout_s=60) as loader:
        if mode == "hold":
            epoch = iter(loader)  # kept: a dropped epoch iterator would end the epoch and its lease
            next(epoch)
            print(json.dumps({"holding": True}), flush=True)
            sys.stdin.read()
            return
        for epoch in range(int(mode)):
            ids = [int(i) for batch in loader for i in batch["id"]]
            print(json.dumps({"epoch": epoch, "samples": len(ids), "ids": len(set(ids))}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
