"""``epochcache plot``: one figure of a cache's life over time, from its ledger's epoch records.

In: a Config (the cache dir, and ``cache.max_bytes`` for the budget line) and an output path. Out: a
PNG (or any format matplotlib writes by the path's suffix) with four panels against minutes since
the first epoch: cache bytes at each epoch against the budget, samples per epoch, coverage and echo
(:mod:`epochcache.cache.coverage`), and the remote read rate between epochs. Reads the ledger only;
matplotlib is an optional extra (``pip install 'epochcache[plot]'``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from epochcache.cache.coverage import of_epoch
from epochcache.cache.ledger import Ledger
from epochcache.config import Config
from epochcache.errors import CacheError, ConfigError, EpochcacheError
from epochcache.tools.clear import existing_layout

# An epoch record per epoch: a long run has thousands, and a figure shows them all.
MAX_EPOCHS = 1_000_000


def plot_cache(config: Config, out: Path) -> int:
    """Write the figure to ``out``; return the number of epochs drawn. Raises :class:`CacheError`
    for a cache without epochs, :class:`EpochcacheError` when matplotlib is not installed,
    :class:`ConfigError` naming ``--out`` when the image cannot be written there."""
    layout = existing_layout(config)
    ledger = Ledger(layout.ledger)
    try:
        epochs = ledger.leases.epochs(last=MAX_EPOCHS)
    finally:
        ledger.close()
    if not epochs:
        raise CacheError(f"no epoch has run on {layout.root} yet: nothing to plot (train on it first)")
    pyplot = _pyplot()
    figure = _figure(pyplot, epochs, int(config.cache.max_bytes))
    try:
        _save(figure, out)
    finally:
        pyplot.close(figure)
    return len(epochs)


def _save(figure: Any, out: Path) -> None:
    """``figure`` written to ``out`` in the format its suffix names; :class:`ConfigError` otherwise."""
    formats = figure.canvas.get_supported_filetypes()
    if out.suffix and out.suffix[1:].lower() not in formats:  # no suffix: matplotlib's default, PNG
        raise ConfigError(f"--out {str(out)!r}: no image format of that suffix; end the name with one of "
                          + ", ".join(f".{name}" for name in sorted(formats)))
    try:
        figure.savefig(out, dpi=120)
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: cannot write the image ({exc.strerror}): give a path in an "
                          "existing folder") from exc


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise EpochcacheError("epochcache plot needs matplotlib: pip install 'epochcache[plot]'") from None
    matplotlib.use("Agg")  # files only: no display is needed or wanted
    return importlib.import_module("matplotlib.pyplot")


def _figure(pyplot: Any, epochs: list[dict[str, Any]], budget: int) -> Any:
    start = epochs[0]["at"]
    minutes = [(e["at"] - start) / 60 for e in epochs]
    figure, (cache, samples, coverage, rate) = pyplot.subplots(4, 1, sharex=True, figsize=(8, 10))
    cache.plot(minutes, [e["cache_bytes"] / 1e6 for e in epochs], marker=".", label="cache (at each epoch)")
    cache.axhline(budget / 1e6, color="red", linestyle="--", label="budget")
    cache.set_ylabel("MB")
    cache.legend(loc="lower right")
    samples.plot(minutes, [e["samples"] for e in epochs], marker=".", drawstyle="steps-post")
    samples.set_ylabel("samples per epoch")
    covered = [of_epoch(e) for e in epochs]
    coverage.plot(minutes, [100 * (c.coverage or 0) for c in covered], marker=".", color="green")
    coverage.set_ylabel("coverage (%)", color="green")
    echo = coverage.twinx()
    echo.plot(minutes, [c.echo or 0 for c in covered], marker=".", color="purple")
    echo.set_ylabel("echo", color="purple")
    rates = [0.0] + [(b["fetched_bytes"] - a["fetched_bytes"]) / 1e6 / max(b["at"] - a["at"], 1e-9)
                     for a, b in zip(epochs, epochs[1:])]
    rate.step(minutes, rates, where="post")
    rate.set_ylabel("remote read (MB/s)")
    rate.set_xlabel("minutes since the first epoch")
    figure.suptitle(f"epochcache: {len(epochs)} epochs")
    figure.tight_layout()
    return figure
