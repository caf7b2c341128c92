"""benchmarks/peers.py, the peer comparison: it runs end to end for epochcache alone (the peers are never
installed for the tests), and a peer that is not installed is skipped with a line saying so."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
EPOCHCACHE_ROWS = {"epochcache thread, bytes", "epochcache thread, tensor", "epochcache 2 workers, bytes",
                   "epochcache thread, bytes, maps<=8M"}


def _peers(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PEERS), *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.soak
def test_epochcache_alone_end_to_end_every_epoch_exact_and_within_the_budget(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    run = _peers("--systems", "epochcache", "--count", "300", "--size", "1024", "--rounds", "1",
                 "--warm-epochs", "2", "--shard-mb", "1", "--budget-mb", "4", "--dir", str(tmp_path),
                 "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["systems"]) == EPOCHCACHE_ROWS
    for name, entry in result["systems"].items():
        median = entry["median"]
        assert median["exact_epochs"] == median["epochs"] == 3, (name, entry["rounds"][0]["checks"])
        assert median["cold_samples_per_s"] > 0 and median["warm_samples_per_s"] > 0, name
        assert 0 < median["first_batch_s"] < 60, name
        assert 0 < median["first_shard_s"] <= median["first_batch_s"], name  # the daemon's part of the wait
        assert median["daemon_imports_s"] > 0, name  # timed apart, before the clock
        assert 0 < median["peak_pss_anon_bytes"] < median["peak_pss_bytes"], name  # less the mapped files
        assert 0 < median["peak_daemon_pss_bytes"] < median["peak_pss_bytes"], name  # the daemon measured apart
        assert 0 < median["peak_trainer_pss_bytes"] <= median["peak_pss_bytes"], name  # the daemon may be gone then
        assert 0 < median["peak_trainer_pss_anon_bytes"] < median["peak_trainer_pss_bytes"], name
        assert 0 < median["peak_cache_bytes"] <= 4 * 2**20, name  # the daemon filled the cache within its budget
        assert median["cold_cpu_us_per_sample"] > 0, name
        assert name in run.stdout  # the table
        assert f"{name}: daemon " in run.stdout
    assert [p for p in tmp_path.iterdir() if p.name != "peers.json"] == []  # caches and uploads cleaned up


@pytest.mark.skipif(importlib.util.find_spec("litdata") is not None, reason="litdata is installed here")
def test_a_peer_that_is_not_installed_is_skipped_with_a_line(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    run = _peers("--systems", "litdata", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "litdata: not installed, skipped (pip install litdata)" in run.stdout
    assert "nothing to measure" in run.stdout
    assert not out.exists()


def test_an_unknown_system_is_refused_naming_the_choices(tmp_path: Path) -> None:
    run = _peers("--systems", "epochcache,tfdata", cwd=tmp_path)
    assert run.returncode == 2
    assert "['tfdata']" in run.stderr and "epochcache,litdata,webdataset,streaming" in run.stderr
