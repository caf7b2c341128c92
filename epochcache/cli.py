"""The epochcache command: sync, status, verify, gc, clear and demo.

Every EpochcacheError (and a missing-credentials error of the S3 client) ends the command with one
line on stderr (``epochcache: error: ...``, secrets masked) and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from epochcache.cache.layout import bytes_under
from epochcache.config import Config, load_config
from epochcache.errors import ConfigError, EpochcacheError, causes
from epochcache.redact import install_filter, redact_text

log = logging.getLogger("epochcache")

DEFAULT_CONFIG = Path("config.yaml")

DESCRIPTION = """\
Train PyTorch on a remote dataset far larger than the local disk: a sync daemon samples the remote
into a local cache of Arrow shards under a hard byte budget; EpochCachedLoader trains on them.
"""

EPILOG = """\
configuration:
  config.yaml in the project is the complete, commented reference: every key, its default and
  meaning (also in README.md, section Configuration). Precedence, lowest first: defaults < the YAML
  file < environment variables EPOCHCACHE_<SECTION>__<KEY> (e.g. EPOCHCACHE_CACHE__MAX_BYTES=20GB)
  < --set section.key=value. Errors name where the bad value was written.

exit codes:
  0  done (sync --once: every unit read)
  1  verify found problems (without --fix); clear was not confirmed; an unexpected failure (a bug:
     please report it)
  2  an error of configuration, credentials, the remote or the cache: one line on stderr
  3  sync --once finished, but some units were skipped and are still unread (see: epochcache status)

-v shows epochcache's debug lines, -vv also the S3 client's and other libraries' info lines.
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(getattr(args, "verbose", 0) or 0)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # (here, so that a reader gone is seen below, not at exit)
        return code
    except EpochcacheError as exc:
        return _fail(str(exc))
    except BrokenPipeError:
        # The reader of our output left (``epochcache status | head``): as a Unix tool does, stop
        # quietly. stdout goes to /dev/null first, or flushing it at exit raises again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # (128 + SIGPIPE, what a shell reports for a tool SIGPIPE ended)
    except Exception as exc:
        # The S3 client raises its credential errors from deep inside a request: one line, not 80.
        if not _no_credentials(exc):
            raise
        return _fail(f"no credentials for the remote ({exc}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                     "(or AWS_PROFILE), or storage_options.anon: true for a public bucket")


def _fail(message: str) -> int:
    print(f"epochcache: error: {redact_text(message)}", file=sys.stderr)
    return 2


def _no_credentials(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is botocore's missing/partial credentials."""
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    except ImportError:  # no S3 client installed: it cannot have raised one
        return False
    return any(isinstance(seen, (NoCredentialsError, PartialCredentialsError)) for seen in causes(exc))


def _setup_logging(verbose: int) -> None:
    """epochcache's own lines at INFO (DEBUG with -v); libraries' only at WARNING, or INFO with -vv
    (never their DEBUG: botocore's carries request headers); every line through the redaction filter."""
    logging.basicConfig(level=logging.INFO if verbose >= 2 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    install_filter()


def _parser() -> argparse.ArgumentParser:
    # -v is accepted before and after the command: a parent parser gives every subparser its own -v.
    verbosity = argparse.ArgumentParser(add_help=False)
    verbosity.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                           help="-v: epochcache's debug lines; -vv: also libraries' info lines")
    parser = argparse.ArgumentParser(prog="epochcache", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, parents=[verbosity])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, epilog=EPILOG, parents=[verbosity],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    sync = command("sync", "run the sync daemon: sample the remote into the cache")
    _add_config_args(sync)
    sync.add_argument("--once", action="store_true",
                      help="stop when the budget is full or one pass is done (exit 3 if units stayed unread)")
    sync.add_argument("--no-progress", action="store_true", help="no progress bar")
    sync.set_defaults(func=_sync)

    status = command("status", "show the cache and its daemon: uptime, last error, settings, shards, "
                               "budget, leases, skipped units, progress")
    _add_config_args(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=_status)

    verify = command("verify", "check shards, checksums and ledger agree; exit 1 if not")
    _add_config_args(verify)
    verify.add_argument("--fix", action="store_true",
                        help="repair what disagrees (needs the daemon stopped): remove debris, adopt whole "
                             "unknown shards, drop missing records, quarantine corrupt shards")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    verify.add_argument("--no-progress", action="store_true", help="no progress bar")
    verify.set_defaults(func=_verify)

    gc = command("gc", "delete quarantined shards and expired leases (and crash debris if no daemon runs)")
    _add_config_args(gc)
    gc.set_defaults(func=_gc)

    clear = command("clear", "empty the cache (shards, quarantine, ledger) so it can hold another dataset; "
                             "refused while a daemon runs or a trainer holds a lease")
    _add_config_args(clear)
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    clear.add_argument("--no-progress", action="store_true", help="no progress bar")
    clear.set_defaults(func=_clear)

    plot = command("plot", "draw the cache's life over its epochs (cache bytes vs budget, samples per epoch, "
                           "coverage and echo, remote read rate) into an image; needs epochcache[plot]")
    _add_config_args(plot)
    plot.add_argument("--out", type=Path, default=Path("cache.png"), help="image file (default: %(default)s)")
    plot.set_defaults(func=_plot)

    demo = command("demo", "generate a local dataset, sync it and train on it")
    demo.add_argument("--dir", type=Path, default=Path("epochcache-demo"),
                      help="demo folder (default: %(default)s)")
    demo.add_argument("--epochs", type=int, default=12, help="epochs to train (default: %(default)s)")
    demo.add_argument("--samples", type=int, default=24576,
                      help="samples in the generated remote (default: %(default)s)")
    demo.set_defaults(func=_demo)
    return parser


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", type=Path, default=DEFAULT_CONFIG,
                        help="config file (default: %(default)s)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set cache.max_bytes=20GB (repeatable)",
    )


def _config(args: argparse.Namespace) -> Config:
    """The command's validated config; without ``--config``, a missing ./config.yaml says to give one."""
    if args.config == DEFAULT_CONFIG and not DEFAULT_CONFIG.exists():
        raise ConfigError(f"no {DEFAULT_CONFIG} in the current folder ({Path.cwd()}): give the config file "
                          "with --config PATH")
    return load_config(args.config, args.overrides)


def _sync(args: argparse.Namespace) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from epochcache.sync.daemon import SyncDaemon

    config = _config(args)
    _warn_if_budget_exceeds_disk(config)
    with logging_redirect_tqdm():  # log lines print above the progress bar, not into it
        install_filter()  # on the handler the redirect put in place (older tqdm does not copy filters)
        report = SyncDaemon(config, progress=_progress(args)).run(once=args.once)
    log.info(
        "%s: %d shards (%d samples, %d bytes) published, %d evicted",
        report.reason.value, report.shards_published, report.samples_published,
        report.bytes_published, report.evicted,
    )
    if report.units_unread:
        log.warning("%d units were skipped and are still unread: see `epochcache status` for the reasons",
                    report.units_unread)
        return 3
    return 0


def _warn_if_budget_exceeds_disk(config: Config) -> None:
    """Warn when ``cache.max_bytes`` is more than the cache's filesystem can give: its free space plus
    what the cache already holds (summed only if the free space alone is less than the budget)."""
    path = Path(config.cache.dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    budget = int(config.cache.max_bytes)
    if budget > free and budget > free + (held := bytes_under(Path(config.cache.dir))):
        from epochcache.tools.status import human_bytes

        log.warning("cache.max_bytes=%s is more than the cache's filesystem can hold (%s free, %s already "
                    "cached): the disk fills before the budget; lower cache.max_bytes or free space",
                    human_bytes(budget), human_bytes(free), human_bytes(held))


def _status(args: argparse.Namespace) -> int:
    from epochcache.tools.status import cache_status, format_status

    config = _config(args)
    status = cache_status(config)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _progress(args: argparse.Namespace) -> bool | None:
    """A command's progress bars: on a terminal unless ``--no-progress`` (None: tqdm asks stderr)."""
    return False if args.no_progress else None


def _verify(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from epochcache.tools.maintenance import verify_cache

    repairs, live = verify_cache(_config(args), fix=args.fix, progress=_progress(args))
    if args.json:
        print(json.dumps({**asdict(repairs), "problems": repairs.problems, "daemon_running": live}))
    else:
        counts = asdict(repairs).items()
        found = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in counts if n) or "nothing wrong"
        print(f"verify{' --fix' if args.fix else ''}: {found}{' (fixed)' if args.fix and repairs.problems else ''}")
    return 1 if repairs.problems and not args.fix else 0


def _gc(args: argparse.Namespace) -> int:
    from epochcache.tools.maintenance import collect_garbage

    done = collect_garbage(_config(args))
    print("gc: " + ", ".join(f"{n} {what}" for what, n in done.items()))
    return 0


def _clear(args: argparse.Namespace) -> int:
    from epochcache.tools.clear import clear_cache, existing_layout

    config = _config(args)
    root = existing_layout(config).root
    if not args.yes:
        if not sys.stdin.isatty():
            return _fail(f"clear deletes every shard and the ledger of {str(root)!r}: add --yes to confirm")
        if input(f"delete every shard and the ledger of {root}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("clear: nothing deleted")
            return 1
    done = clear_cache(config, progress=_progress(args))
    print(f"clear: {done['shards']} shards and {done['quarantined']} quarantined shards deleted "
          f"({done['bytes']} bytes), ledger emptied: {root}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from epochcache.tools.plot import plot_cache

    drawn = plot_cache(_config(args), args.out)
    print(f"plot: {drawn} epochs drawn into {args.out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from epochcache.tools.demo import run_demo

    run_demo(args.dir, epochs=args.epochs, samples=args.samples)
    return 0
