"""What a cache directory holds right now, for ``epochcache status`` and the demo.

Flow: Config -> ``cache_status`` (a JSON-ready dict read from the ledger, never from a directory
scan) -> ``format_status`` (a text table). Nothing here writes to the cache.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ByteSize

from epochcache.config import Config
from epochcache.layout import CacheLayout
from epochcache.ledger import Ledger
from epochcache.lockfile import holder

# The per-shard table lists this many of the newest shards; the totals cover all of them.
SHARD_ROWS = 20


def cache_status(config: Config) -> dict[str, Any]:
    """A JSON-ready summary: shards, samples, bytes vs budget, leases, evictions, quarantine,
    the daemon's state and the sampler's progress through the current pass."""
    layout = CacheLayout.create(config.cache.dir)
    ledger = Ledger(layout.ledger)
    try:
        usage = ledger.usage()
        now = time.time()
        shards = ledger.shards()
        cursor = ledger.cursor()
        return {
            "cache_dir": str(layout.root),
            "source": ", ".join(source.url for source in config.sources),
            "daemon": _daemon(layout, ledger.daemon_state(), now),
            "shards": usage.shards,
            "samples": usage.rows,
            "bytes": usage.total,
            "shard_bytes": usage.shard_bytes,
            "reserved_bytes": usage.reserved_bytes,
            "quarantined_bytes": usage.quarantined_bytes,
            "ledger_bytes": usage.ledger_bytes,
            "max_bytes": int(config.cache.max_bytes),
            "eviction": config.cache.eviction,
            "max_uses": config.cache.max_uses,
            "shard_list": [
                {"id": r.id, "rows": r.rows, "bytes": r.nbytes, "age_s": round(now - r.created, 1), "uses": r.uses}
                for r in reversed(shards[-SHARD_ROWS:])
            ],
            "leases": [
                {"owner": lease["owner"], "shards": len(lease["shards"]),
                 "age_s": round(now - lease.get("taken", now), 1), "expires_in_s": round(lease["expires"] - now, 1)}
                for lease in ledger.leases()
            ],
            "evictions": _evictions(ledger.counters()),
            "quarantined": [
                {"id": q.record.id, "bytes": q.record.nbytes, "reason": q.reason, "age_s": round(now - q.at, 1)}
                for q in ledger.quarantined()
            ],
            "counters": ledger.counters(),
            "progress": (cursor or {}).get("progress"),
            "cursor": cursor,
        }
    finally:
        ledger.close()


def format_status(status: dict[str, Any]) -> str:
    """The summary as an aligned two-column table, then the newest shards as a table."""
    used, budget = status["bytes"], status["max_bytes"]
    counters = status["counters"]
    by_policy = ", ".join(f"{n} {name}" for name, n in status["evictions"].items()) or "none"
    rows = [
        ("cache dir", status["cache_dir"]),
        ("source", status["source"]),
        ("daemon", status["daemon"]),
        ("shards", f"{status['shards']}"),
        ("samples", f"{status['samples']}"),
        ("bytes", f"{human_bytes(used)} of {human_bytes(budget)} ({100 * used / budget:.1f}%): " + ", ".join(
            f"{part} {human_bytes(status[key])}" for part, key in
            (("shards", "shard_bytes"), ("writing", "reserved_bytes"), ("quarantine", "quarantined_bytes"),
             ("ledger", "ledger_bytes")))),
        ("policy", status["eviction"] + (f", max_uses {status['max_uses']}" if status["max_uses"] else "")),
        ("leases", f"{len(status['leases'])}"),
        *((f"  {lease['owner']}", f"{lease['shards']} shards, age {lease['age_s']}s, "
           f"expires in {lease['expires_in_s']}s") for lease in status["leases"]),
        ("published", f"{counters.get('published', 0)}"),
        ("evicted", f"{counters.get('evicted', 0)} ({by_policy})"),
        ("quarantined", f"{counters.get('quarantined', 0)} so far, {len(status['quarantined'])} kept"),
        *((f"  {q['id']}", f"{human_bytes(q['bytes'])}, {q['age_s']}s ago: {q['reason']}")
          for q in status["quarantined"]),
        ("progress", _progress(status["progress"], status["cursor"])),
    ]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    if status["shard_list"]:
        lines += ["", f"newest {len(status['shard_list'])} of {status['shards']} shards:",
                  f"  {'id':<26} {'rows':>8} {'bytes':>10} {'age':>9} {'uses':>5}"]
        lines += [f"  {s['id']:<26} {s['rows']:>8} {human_bytes(s['bytes']):>10} {s['age_s']:>8}s {s['uses']:>5}"
                  for s in status["shard_list"]]
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    return ByteSize(n).human_readable(decimal=True)


def _daemon(layout: CacheLayout, state: dict[str, Any] | None, now: float) -> str:
    """"running pid N: <state> since ...", or why no daemon runs."""
    pid = holder(layout.lock)
    if pid is None:
        last = f" (last pid {state['pid']})" if state else ""
        return f"not running{last}"
    if state is None or state.get("pid") != pid:
        return f"locked by pid {pid}"
    detail = f" ({state['error']})" if state.get("error") else ""
    return f"running pid {pid}: {state['state']} for {now - state['since']:.0f}s{detail}"


def _evictions(counters: dict[str, int]) -> dict[str, int]:
    return {name.removeprefix("evicted."): n for name, n in sorted(counters.items()) if name.startswith("evicted.")}


def _progress(progress: dict[str, int | None] | None, cursor: dict[str, Any] | None) -> str:
    """The sampler's progress mapping as ``key value`` pairs, else the raw cursor."""
    if progress:
        return ", ".join(f"{key} {'?' if value is None else value}" for key, value in progress.items())
    return f"{cursor}" if cursor else "not started"
