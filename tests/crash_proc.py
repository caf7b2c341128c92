"""A sync daemon that stops dead at one chosen point of a publish, for kill -9 tests (fault injection).

``python crash_proc.py CONFIG write``: the next shard's temp file gets half its bytes, then the
process prints ``blocked`` and waits on stdin. ``... publish``: the next shard is written and renamed,
then it blocks just before the ledger records it. The test kills it with SIGKILL there.
"""

from __future__ import annotations

import sys
from typing import Any

import pyarrow as pa

import epochcache.cache.shards as shards
from epochcache.cache.ledger import Ledger
from epochcache.config import load_config
from epochcache.sync.daemon import SyncDaemon


def _block() -> None:
    print("blocked", flush=True)
    sys.stdin.read()


def main(config_path: str, where: str) -> None:
    if where == "write":
        def half_then_block(sink: pa.NativeFile, table: pa.Table) -> None:
            if isinstance(sink, pa.MockOutputStream):  # sizing, not writing
                return real_write(sink, table)
            sink.write(b"ARROW1\x00\x00" + b"\x00" * 4096)
            sink.flush()
            _block()

        real_write = shards._write_ipc
        shards._write_ipc = half_then_block
    else:
        def block_before_publish(self: Ledger, record: Any, cursor: Any = None) -> None:
            _block()

        Ledger.publish = block_before_publish  # type: ignore[method-assign]
    SyncDaemon(load_config(config_path), progress=False).run()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
