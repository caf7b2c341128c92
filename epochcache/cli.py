"""The ``epochcache`` command: ``sync``, ``status``, ``verify``, ``gc`` and ``demo``.

Every :class:`EpochcacheError` ends the command with one line on stderr (``epochcache: error: ...``)
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from epochcache.config import load_config
from epochcache.errors import EpochcacheError

log = logging.getLogger("epochcache")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Only our logger gets DEBUG: botocore's debug lines carry request headers, credentials included.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args.func(args))
    except EpochcacheError as exc:
        print(f"epochcache: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epochcache", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging of epochcache itself")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    sync = commands.add_parser("sync", help="run the sync daemon: sample the remote into the cache")
    _add_config_args(sync)
    sync.add_argument("--once", action="store_true", help="stop when the budget is full or one pass is done")
    sync.add_argument("--no-progress", action="store_true", help="no progress bar")
    sync.set_defaults(func=_sync)

    status = commands.add_parser("status", help="show the cache: shards, bytes vs budget, leases")
    _add_config_args(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=_status)

    verify = commands.add_parser("verify", help="check shards, checksums and ledger agree; exit 1 if not")
    _add_config_args(verify)
    verify.add_argument("--fix", action="store_true",
                        help="repair what disagrees (needs the daemon stopped): remove debris, adopt whole "
                             "unknown shards, drop missing records, quarantine corrupt shards")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    verify.set_defaults(func=_verify)

    gc = commands.add_parser("gc", help="delete quarantined shards and expired leases (and crash debris if "
                                        "no daemon runs)")
    _add_config_args(gc)
    gc.set_defaults(func=_gc)

    demo = commands.add_parser("demo", help="generate a local dataset, sync it and train on it")
    demo.add_argument("--dir", type=Path, default=Path("epochcache-demo"), help="demo folder (default: %(default)s)")
    demo.add_argument("--epochs", type=int, default=12, help="epochs to train (default: %(default)s)")
    demo.add_argument("--samples", type=int, default=24576, help="samples in the generated remote (default: %(default)s)")
    demo.set_defaults(func=_demo)
    return parser


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", type=Path, default=Path("config.yaml"), help="config file (default: %(default)s)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set cache.max_bytes=20GB (repeatable)",
    )


def _sync(args: argparse.Namespace) -> int:
    from epochcache.daemon import SyncDaemon

    config = load_config(args.config, args.overrides)
    report = SyncDaemon(config, progress=False if args.no_progress else None).run(once=args.once)
    log.info(
        "%s: %d shards (%d samples, %d bytes) published, %d evicted",
        report.reason.value, report.shards_published, report.samples_published,
        report.bytes_published, report.evicted,
    )
    return 0


def _status(args: argparse.Namespace) -> int:
    from epochcache.status import cache_status, format_status

    config = load_config(args.config, args.overrides)
    status = cache_status(config)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from epochcache.maintenance import verify_cache

    repairs, live = verify_cache(load_config(args.config, args.overrides), fix=args.fix)
    if args.json:
        print(json.dumps({**asdict(repairs), "problems": repairs.problems, "daemon_running": live}))
    else:
        counts = asdict(repairs).items()
        found = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in counts if n) or "nothing wrong"
        print(f"verify{' --fix' if args.fix else ''}: {found}{' (fixed)' if args.fix and repairs.problems else ''}")
    return 1 if repairs.problems and not args.fix else 0


def _gc(args: argparse.Namespace) -> int:
    from epochcache.maintenance import collect_garbage

    done = collect_garbage(load_config(args.config, args.overrides))
    print("gc: " + ", ".join(f"{n} {what}" for what, n in done.items()))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from epochcache.demo import run_demo

    run_demo(args.dir, epochs=args.epochs, samples=args.samples)
    return 0
