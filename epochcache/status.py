"""What a cache directory holds right now, for ``epochcache status`` and the demo."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ByteSize

from epochcache.config import Config
from epochcache.layout import CacheLayout
from epochcache.ledger import Ledger


def cache_status(config: Config) -> dict[str, Any]:
    """A JSON-ready summary: shards, samples, bytes vs budget, leases, counters, sampler cursor."""
    layout = CacheLayout.create(config.cache.dir)
    ledger = Ledger(layout.ledger)
    try:
        usage = ledger.usage()
        now = time.time()
        return {
            "cache_dir": str(layout.root),
            "source": config.source.url,
            "shards": usage.shards,
            "samples": usage.rows,
            "bytes": usage.total,
            "shard_bytes": usage.shard_bytes,
            "ledger_bytes": usage.ledger_bytes,
            "max_bytes": int(config.cache.max_bytes),
            "leases": [
                {"owner": lease["owner"], "shards": len(lease["shards"]), "expires_in_s": round(lease["expires"] - now, 1)}
                for lease in ledger.leases()
            ],
            "counters": ledger.counters(),
            "cursor": ledger.cursor(),
        }
    finally:
        ledger.close()


def format_status(status: dict[str, Any]) -> str:
    """The summary as an aligned two-column table."""
    used, budget = status["bytes"], status["max_bytes"]
    rows = [
        ("cache dir", status["cache_dir"]),
        ("source", status["source"]),
        ("shards", f"{status['shards']}"),
        ("samples", f"{status['samples']}"),
        ("bytes", f"{human_bytes(used)} of {human_bytes(budget)} ({100 * used / budget:.1f}%)"),
        ("leases", f"{len(status['leases'])}"),
        *((f"  lease {lease['owner']}", f"{lease['shards']} shards, expires in {lease['expires_in_s']}s")
          for lease in status["leases"]),
        ("published", f"{status['counters'].get('published', 0)}"),
        ("evicted", f"{status['counters'].get('evicted', 0)}"),
        ("cursor", f"{status['cursor']}"),
    ]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


def human_bytes(n: int) -> str:
    return ByteSize(n).human_readable(decimal=True)
