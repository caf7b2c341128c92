"""What a cache directory holds right now, for ``epochcache status`` and the demo.

Flow: Config -> ``cache_status`` (a JSON-ready dict read from the ledger, never from a directory
scan, and from the state the running daemon records there) -> ``format_status`` (a text table).
Nothing here writes to the cache, and a cache dir that does not exist is an error, never created.
The daemon part reports what the daemon itself recorded (its effective settings, its uptime, its
last error), not the config file given to ``status``. Secrets in recorded settings are masked.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from pydantic import ByteSize

from epochcache.cache.coverage import coverage_of
from epochcache.cache.layout import CacheLayout, bytes_under
from epochcache.cache.ledger import Ledger
from epochcache.cache.lockfile import holder
from epochcache.config import Config
from epochcache.redact import redact
from epochcache.tools.clear import existing_layout

# The per-shard and skipped-unit tables list this many rows; the totals cover all of them.
SHARD_ROWS = 20
SKIPPED_ROWS = 20


def cache_status(config: Config) -> dict[str, Any]:
    """A JSON-ready summary: shards, samples, bytes vs budget, leases, evictions, quarantine, coverage
    and echo of the epochs so far (:mod:`epochcache.cache.coverage`),
    the daemon's state (uptime, last error, effective settings, fetch rate), skipped units with
    their reasons and the sampler's progress through the current pass. :class:`CacheError` if
    ``config.cache.dir`` holds no cache."""
    layout = existing_layout(config)
    ledger = Ledger(layout.ledger)
    try:
        usage = ledger.usage()
        footers = bytes_under(layout.footers)  # (a database and its journal: a few files)
        now = time.time()
        cursor = ledger.daemon.cursor()
        skipped = ledger.daemon.skipped()
        daemon = daemon_status(layout, ledger.daemon.status(), now)
        return {
            "cache_dir": str(layout.root),
            "source": ", ".join(source.url for source in config.sources),
            "daemon": daemon.pop("summary"),  # one line; the details below
            "daemon_detail": daemon,
            "shards": usage.shards,
            "samples": usage.rows,
            "bytes": usage.total + footers,
            "shard_bytes": usage.shard_bytes,
            "reserved_bytes": usage.reserved_bytes,
            "quarantined_bytes": usage.quarantined_bytes,
            "ledger_bytes": usage.ledger_bytes,
            "footer_bytes": footers,
            # The running daemon's budget (its --set / env included) when it recorded one, else the file's.
            "max_bytes": int(_setting(daemon, "cache.max_bytes", config.cache.max_bytes)),
            "eviction": config.cache.eviction,
            "max_uses": config.cache.max_uses,
            "shard_list": [
                {"id": r.id, "rows": r.rows, "bytes": r.nbytes, "age_s": round(now - r.created, 1), "uses": r.uses}
                for r in ledger.newest(SHARD_ROWS)
            ],
            "leases": [
                {"owner": lease["owner"], "shards": lease["shards"],
                 "age_s": round(now - lease.get("taken", now), 1), "expires_in_s": round(lease["expires"] - now, 1)}
                for lease in ledger.leases.live(with_shards=False)
            ],
            "evictions": _evictions(ledger.counters.all()),
            "quarantined": [
                {"id": q.record.id, "bytes": q.record.nbytes, "reason": q.reason, "age_s": round(now - q.at, 1)}
                for q in ledger.quarantine.entries()
            ],
            "skipped_units": len(skipped),
            "skipped": [
                {"unit": key, "path": info.get("path"), "index": info.get("index"), "reason": info.get("error"),
                 "final": bool(info.get("final"))}
                for key, info in sorted(skipped.items())[:SKIPPED_ROWS]
            ],
            "counters": ledger.counters.all(),
            "coverage": None if (covered := coverage_of(ledger)) is None else covered.to_dict(),
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
        *_daemon_rows(status["daemon_detail"]),
        ("shards", f"{status['shards']}"),
        ("samples", f"{status['samples']}"),
        ("bytes", f"{human_bytes(used)} of {human_bytes(budget)} ({100 * used / budget:.1f}%): " + ", ".join(
            f"{part} {human_bytes(status[key])}" for part, key in
            (("shards", "shard_bytes"), ("writing", "reserved_bytes"), ("quarantine", "quarantined_bytes"),
             ("ledger", "ledger_bytes"), ("footers", "footer_bytes")))),
        ("policy", status["eviction"] + (f", max_uses {status['max_uses']}" if status["max_uses"] else "")),
        ("leases", f"{len(status['leases'])}"),
        *((f"  {lease['owner']}", f"{lease['shards']} shards, age {lease['age_s']}s, "
           f"expires in {lease['expires_in_s']}s") for lease in status["leases"]),
        ("published", f"{counters.get('published', 0)}"),
        ("evicted", f"{counters.get('evicted', 0)} ({by_policy})"),
        ("quarantined", f"{counters.get('quarantined', 0)} so far, {len(status['quarantined'])} kept"),
        *((f"  {q['id']}", f"{human_bytes(q['bytes'])}, {q['age_s']}s ago: {q['reason']}")
          for q in status["quarantined"]),
        ("skipped units", f"{status['skipped_units']}" + (" (retried at the end of each pass)"
                                                           if status["skipped_units"] else "")),
        *((f"  {u['unit']}", ("failed again at the pass end: " if u["final"] else "") + f"{u['reason']}")
          for u in status["skipped"]),
        ("coverage", _coverage(status["coverage"])),
        ("progress", _progress(status["progress"], status["cursor"])),
        *_source_rows(status["progress"]),
    ]
    # Sub-rows (skipped unit keys, lease owners) may be long: they overflow, the table keeps its width.
    width = max(len(key) for key, _ in rows if not key.startswith("  "))
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    if status["shard_list"]:
        lines += ["", f"newest {len(status['shard_list'])} of {status['shards']} shards:",
                  f"  {'id':<26} {'rows':>8} {'bytes':>10} {'age':>9} {'uses':>5}"]
        lines += [f"  {s['id']:<26} {s['rows']:>8} {human_bytes(s['bytes']):>10} {s['age_s']:>8}s {s['uses']:>5}"
                  for s in status["shard_list"]]
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    return ByteSize(n).human_readable(decimal=True)


def daemon_status(layout: CacheLayout, state: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """The daemon as JSON: ``running``, ``pid``, ``state``, ``in_state_s``, ``uptime_s``,
    ``last_error`` / ``last_error_at``, ``fetch_bytes_per_s``, ``units_unread``, ``listing`` (a listing
    under way: url, objects so far, since), ``settings`` (masked)
    and a one-line ``summary``. Every recorded key is read
    with ``.get``: a daemon of another version may record fewer."""
    pid = holder(layout.lock)
    state = state or {}
    ours = pid is not None and state.get("pid") == pid
    started = state.get("started")
    uptime = now - started if ours and isinstance(started, (int, float)) else None
    fetched = state.get("fetched_bytes")
    out: dict[str, Any] = {
        "running": pid is not None,
        "pid": pid,
        "state": state.get("state") if ours else None,
        "in_state_s": round(now - state["since"], 1) if ours and "since" in state else None,
        "uptime_s": None if uptime is None else round(uptime, 1),
        "last_error": state.get("last_error") or state.get("error"),
        "last_error_at": state.get("last_error_at"),
        "fetched_bytes": fetched,
        "fetch_bytes_per_s": round(fetched / uptime) if uptime and isinstance(fetched, (int, float)) else None,
        "units_unread": state.get("units_unread"),
        "listing": state.get("listing") if ours else None,
        "settings": redact(state.get("settings") or {}),
    }
    out["summary"] = _summary(out, state)
    return out


def _summary(daemon: dict[str, Any], state: dict[str, Any]) -> str:
    """"running pid N: <state> for 5s, up 1h02m", or why no daemon runs."""
    if not daemon["running"]:
        return "not running" + (f" (last pid {state['pid']})" if state.get("pid") else "")
    if daemon["state"] is None:
        return f"locked by pid {daemon['pid']}"
    up = f", up {_duration(daemon['uptime_s'])}" if daemon["uptime_s"] is not None else ""
    since = f" for {_duration(daemon['in_state_s'])}" if daemon["in_state_s"] is not None else ""
    return f"running pid {daemon['pid']}: {daemon['state']}{since}{up}"


def _daemon_rows(daemon: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if daemon["last_error"]:  # the daemon's line says since when the outage lasts; this, when it last failed
        at = daemon["last_error_at"]
        latest = f" (latest {datetime.fromtimestamp(at).strftime('%H:%M:%S')})" if isinstance(at, (int, float)) else ""
        rows.append(("last error", f"{daemon['last_error']}{latest}"))
    if daemon["fetched_bytes"] is not None:
        rate = daemon["fetch_bytes_per_s"]
        rows.append(("fetched", human_bytes(int(daemon["fetched_bytes"]))
                     + (f" ({human_bytes(rate)}/s since start)" if rate is not None else "")))
    if daemon["units_unread"]:
        rows.append(("units unread", f"{daemon['units_unread']} (skipped, not yet read again)"))
    listing = daemon["listing"]
    if isinstance(listing, dict):
        since = datetime.fromtimestamp(listing["since"]).strftime("%H:%M:%S") if "since" in listing else "?"
        rows.append(("listing", f"{listing.get('objects', 0):,} objects so far under {listing.get('url')} "
                                f"(since {since})"))
    # The text shows the daemon's own sections; --json has every recorded setting (secrets masked).
    shown = {k: v for k, v in _flat(daemon["settings"]).items() if k.startswith(("cache.", "sampler."))}
    if shown:
        rows.append(("settings", ", ".join(f"{k}={v}" for k, v in shown.items())))
    return rows


def _setting(daemon: dict[str, Any], dotted: str, default: Any) -> Any:
    """A setting the running daemon recorded (flat ``{"cache.max_bytes": ...}`` or nested), else ``default``."""
    settings = daemon["settings"] if daemon["running"] else {}
    value = _flat(settings).get(dotted)
    return default if value is None else value


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _duration(seconds: float) -> str:
    """``42s``, ``5m07s``, ``3h02m``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _coverage(coverage: dict[str, Any] | None) -> str:
    """``12.5% of ~80000 remote samples, echo 2.40 over 7 epochs``."""
    if coverage is None:
        return "no epoch yet"
    share = (f"{100 * coverage['coverage']:.1f}% of ~{coverage['remote_samples']} remote samples"
             if coverage["coverage"] is not None else f"{coverage['distinct_trained']} distinct samples")
    echo = f"{coverage['echo']:.2f}" if coverage["echo"] is not None else "-"
    return f"{share}, echo {echo} over {coverage['epochs']} epochs"


def _evictions(counters: dict[str, int]) -> dict[str, int]:
    return {name.removeprefix("evicted."): n for name, n in sorted(counters.items()) if name.startswith("evicted.")}


def _progress(progress: dict[str, int | None] | None, cursor: dict[str, Any] | None) -> str:
    """This node's share and the skip count; per-source progress follows in :func:`_source_rows`."""
    if progress and "node_rank" in progress:
        node = f"node {progress.get('node_rank')} of {progress.get('num_nodes')}"
        return f"{node}, {progress.get('units_skipped', 0)} unit skips this run"
    if progress:  # a cursor of another shape: its pairs as they are
        return ", ".join(f"{key} {'?' if value is None else value}" for key, value in progress.items())
    return f"{cursor}" if cursor else "not started"


def _source_rows(progress: dict[str, int | None] | None) -> list[tuple[str, str]]:
    """One row per source: ``pass 2: 17 units cached this pass, 16 of 32 objects finished`` (``?``
    while the listing is not complete; objects are interleaved ``sampler.mix_units`` at a time, so
    few finish before the end of their group)."""
    rows = []
    progress = progress or {}
    for prefix in sorted({key[: -len("pass")] for key in progress if key.endswith("pass")}):
        name = prefix.rstrip(".")
        total = progress.get(f"{prefix}objects_total")
        done = progress.get(f"{prefix}objects_done")
        rows.append((f"  {name or 'source'}",
                     f"pass {progress.get(f'{prefix}pass')}: {progress.get(f'{prefix}units_done', '?')} units cached "
                     f"this pass, {done} of {'?' if total is None else total} objects finished"))
    return rows

