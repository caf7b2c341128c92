"""epochcache plot: a figure of the cache's epochs, from the ledger alone; matplotlib is optional."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epochcache import Ledger, ShardRecord
from epochcache.cache.layout import CacheLayout
from epochcache.cli import main


def _cache_with_epochs(tmp_path: Path, epochs: int) -> Path:
    layout = CacheLayout.create(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    for n in range(epochs):
        ledger.publish(ShardRecord(id=f"s{n}", filename=f"s{n}.arrow", nbytes=1000, rows=10, created=float(n),
                                   checksum=f"{n:032x}", units=(f"obj{n}#0",)))
        ledger.counters.incr("fetched_bytes", 1000)
        lease = ledger.leases.snapshot("trainer", ttl_s=60)
        ledger.leases.record_epoch(lease.id, 10)
        ledger.leases.release(lease.id)
    ledger.close()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"source": {"url": str(tmp_path / "remote")},
                                      "cache": {"dir": str(layout.root), "max_bytes": "10MB", "shard_bytes": "1MB"}}))
    return config


@pytest.mark.slow  # (matplotlib: 2-3 s)
def test_plot_draws_every_epoch_into_an_image(tmp_path: Path, capsys) -> None:
    config = _cache_with_epochs(tmp_path, 3)
    out = tmp_path / "cache.png"
    assert main(["plot", "-c", str(config), "--out", str(out)]) == 0
    assert f"3 epochs drawn into {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_of_a_cache_without_epochs_is_one_line(tmp_path: Path, capsys) -> None:
    config = _cache_with_epochs(tmp_path, 0)
    assert main(["plot", "-c", str(config), "--out", str(tmp_path / "x.png")]) == 2
    assert "no epoch has run" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    config = _cache_with_epochs(tmp_path, 1)
    hide = "import sys; sys.modules['matplotlib'] = None; from epochcache.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", hide, "plot", "-c", str(config), "--out", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pip install 'epochcache[plot]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("out", "shown"), [
    ("missing/cache.png", "cannot write the image (No such file or directory): give a path in an existing folder"),
    ("cache.xyz", "no image format of that suffix; end the name with one of .avif, .eps"),
])
def test_an_unwritable_out_is_one_line(tmp_path: Path, capsys, out: str, shown: str) -> None:
    config = _cache_with_epochs(tmp_path, 2)
    assert main(["plot", "-c", str(config), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out '{tmp_path / out}': " in err[0] and shown in err[0], err
