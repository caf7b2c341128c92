"""A training script that never closes its loader, for tests/train/test_exit.py.

``python unclosed_proc.py CACHE_DIR WORKERS MODE``: ``epoch`` iterates one whole epoch (the loader
then prepares the next, and its batch thread fills the places ahead), ``break`` leaves an epoch
after a few batches, ``iter`` keeps an epoch's iterator after its first batch; then prints ``done``
and returns without ``close()``.
"""

from __future__ import annotations

import sys

from epochcache import EpochCachedLoader


def main(cache_dir: str, workers: int, mode: str) -> None:
    loader = EpochCachedLoader(cache_dir, batch_size=16, num_workers=workers, prefetch_batches=2, progress=False)
    if mode == "epoch":
        for _ in loader:
            pass
    elif mode == "break":
        for number, _ in enumerate(loader):
            if number == 2:
                break
    else:
        epoch = iter(loader)
        next(epoch)
        main.epoch = epoch  # type: ignore[attr-defined]  # held until the interpreter exits
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
