"""The epochcache command: sync --once, status, and the demo end to end (small)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import yaml
from conftest import write_parquet_dataset

from epochcache import Ledger
from epochcache.cli import main


def _config(tmp_path: Path) -> Path:
    remote = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), remote, files=3, rows_per_file=64, rows_per_group=32)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "source": {"url": "remote"},  # relative: resolved against the config file's folder
        "cache": {"dir": "cache", "max_bytes": "5MB", "shard_bytes": "100KB"},
    }))
    return path


def test_sync_once_then_status_json(tmp_path: Path, capsys) -> None:
    config = _config(tmp_path)
    assert main(["sync", "--config", str(config), "--once", "--no-progress"]) == 0
    assert (tmp_path / "cache" / "shards").is_dir()
    capsys.readouterr()
    assert main(["status", "--config", str(config), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["samples"] == 3 * 64 and status["shards"] > 0
    assert 0 < status["bytes"] <= status["max_bytes"] == 5_000_000
    assert main(["status", "--config", str(config)]) == 0
    table = capsys.readouterr().out
    assert "samples" in table and "pass 1: 0 units cached this pass, 0 of ? objects finished" in table, table
    assert status["coverage"] is None and "coverage       no epoch yet" in table
    ledger = Ledger(tmp_path / "cache" / "ledger")
    for _ in range(2):  # two epochs over the whole remote
        lease = ledger.leases.snapshot("trainer", ttl_s=60)
        ledger.leases.record_epoch(lease.id, status["samples"])
        ledger.leases.release(lease.id)
    ledger.close()
    assert main(["status", "--config", str(config), "--json"]) == 0
    coverage = json.loads(capsys.readouterr().out)["coverage"]
    assert coverage["coverage"] == 1.0 and coverage["echo"] == 2.0 and coverage["remote_samples"] == 3 * 64
    assert main(["status", "--config", str(config)]) == 0
    assert "100.0% of ~192 remote samples, echo 2.00 over 2 epochs" in capsys.readouterr().out


def test_set_override_is_validated(tmp_path: Path, capsys) -> None:
    config = _config(tmp_path)
    assert main(["sync", "--config", str(config), "--once", "--set", "cache.max_bytes=lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cache.max_bytes" in err[0] and "'lots'" in err[0]


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "epochcache", "demo", "--dir", str(tmp_path / "demo"), "--epochs", "3",
         "--samples", "1536"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["epoch", "shards"])
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert all(int(row[1]) > 0 and int(row[2]) > 0 for row in rows)
    assert lines[header].split()[8:10] == ["coverage", "echo"] and float(rows[-1][8]) >= 1.0, "echo per epoch"
    assert "sync daemon stopped cleanly" in result.stdout
    assert (tmp_path / "demo" / "remote" / "_COMPLETE.json").exists()


def test_uncreatable_cache_dir_is_one_line(tmp_path: Path, capsys) -> None:
    config = _config(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    code = main(["sync", "--config", str(config), "--once", "--set", f"cache.dir={tmp_path / 'a-file' / 'cache'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot create the cache dir" in err[0]


def _corrupt_one_shard(tmp_path: Path) -> str:
    from epochcache.cache.layout import CacheLayout
    from epochcache.cache.ledger import Ledger

    layout = CacheLayout(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    record = ledger.shards()[0]
    ledger.close()
    path = layout.shards / record.filename
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    return record.id


def test_verify_fix_quarantines_then_gc_deletes(tmp_path: Path, capsys) -> None:
    config = str(_config(tmp_path))
    assert main(["sync", "--config", config, "--once", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", "--config", config]) == 0
    assert capsys.readouterr().out.strip() == "verify: nothing wrong"

    bad = _corrupt_one_shard(tmp_path)
    (tmp_path / "cache" / "shards" / "x.arrow.tmp").write_bytes(b"left by a crash")
    assert main(["verify", "--config", config, "--json"]) == 1  # read-only: finds, changes nothing
    found = json.loads(capsys.readouterr().out)
    assert (found["corrupt"], found["temp_files"], found["problems"]) == (1, 1, 2)
    assert found["daemon_running"] is False
    assert (tmp_path / "cache" / "shards" / "x.arrow.tmp").exists()

    assert main(["verify", "--config", config, "--fix"]) == 0
    assert capsys.readouterr().out.strip() == "verify --fix: 1 temp files, 1 corrupt (fixed)"
    assert main(["verify", "--config", config]) == 0
    capsys.readouterr()
    assert main(["status", "--config", config, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [q["id"] for q in status["quarantined"]] == [bad] and status["quarantined_bytes"] > 0
    assert status["counters"]["quarantined"] == 1 and status["daemon"].startswith("not running (last pid")
    assert main(["status", "--config", config]) == 0
    table = capsys.readouterr().out
    assert f"  {bad}" in table and "1 so far, 1 kept" in table and "newest" in table

    assert main(["gc", "--config", config]) == 0
    assert "1 quarantined shards deleted" in capsys.readouterr().out
    assert list((tmp_path / "cache" / "quarantine").iterdir()) == []
    assert main(["status", "--config", config, "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert after["quarantined"] == [] and after["quarantined_bytes"] == 0


def test_verify_fix_refused_while_a_daemon_runs(tmp_path: Path, capsys) -> None:
    from epochcache.cache.layout import CacheLayout
    from epochcache.cache.lockfile import exclusive

    config = str(_config(tmp_path))
    layout = CacheLayout.create(tmp_path / "cache")
    with exclusive(layout.lock):  # as the running daemon holds it
        assert main(["verify", "--config", config, "--fix"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "verify --fix" in err[0] and "stop it first" in err[0]
        assert main(["verify", "--config", config, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["daemon_running"] is True


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m epochcache ARGS`` in a real process; its output and exit code."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                           os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "epochcache", *args], capture_output=True, text=True,
                          timeout=120, env=full_env, cwd=cwd)


@pytest.mark.slow  # (CLI processes: 2 s)
def test_help_points_to_the_reference_and_env_vars_without_markup() -> None:
    for args in (["--help"], ["sync", "--help"], ["clear", "--help"]):
        result = _cli(*args)
        assert result.returncode == 0, result.stderr
        assert "``" not in result.stdout
        assert "config.yaml" in result.stdout and "EPOCHCACHE_<SECTION>__<KEY>" in result.stdout
        assert "exit codes" in result.stdout and "3  sync --once" in result.stdout


def test_env_var_error_names_the_variable_not_the_file(tmp_path: Path) -> None:
    config = _config(tmp_path)
    result = _cli("status", "--config", str(config), env={"EPOCHCACHE_CACHE__MAX_BYTES": "lots"})
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, result.stderr
    assert err[0].startswith("epochcache: error: environment variable EPOCHCACHE_CACHE__MAX_BYTES: cache.max_bytes")
    assert str(config) not in err[0]


@pytest.mark.slow  # (CLI processes)
def test_verbose_flag_after_the_command_and_library_info_quiet(tmp_path: Path) -> None:
    config = _config(tmp_path)
    result = _cli("sync", "--config", str(config), "--once", "--no-progress", "-v")
    assert result.returncode == 0, result.stderr
    assert "DEBUG epochcache" in result.stderr
    assert "INFO botocore" not in result.stderr and "INFO aiobotocore" not in result.stderr


def test_status_of_a_mistyped_cache_dir_is_one_line_and_creates_nothing(tmp_path: Path) -> None:
    config = _config(tmp_path)
    result = _cli("status", "--config", str(config), "--set", "cache.dir=cahce")
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, result.stderr
    assert "cache.dir" in err[0] and "cahce" in err[0] and "does not exist" in err[0]
    assert not (tmp_path / "cahce").exists()


@pytest.mark.slow  # (a CLI process)
def test_no_credentials_is_one_line_exit_2(s3_endpoint: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "source": {"url": "s3://no-such-bucket-creds/data/",
                   "storage_options": {"client_kwargs": {"endpoint_url": s3_endpoint}}},
        # a budget any disk holds: the default 10GB warns on a fuller disk, a second stderr line
        "cache": {"dir": "cache", "max_bytes": "5MB"},
        "sampler": {"max_attempts": 1},
    }))
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env |= {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}
    result = subprocess.run([sys.executable, "-m", "epochcache", "sync", "--config", str(path), "--once",
                             "--no-progress"], capture_output=True, text=True, timeout=120, env=env)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(err) == 1 and err[0].startswith("epochcache: error:") and "credentials" in err[0].lower(), err


def test_sync_once_exits_3_when_units_stay_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from epochcache.sync.daemon import SyncDaemon, SyncReport

    config = _config(tmp_path)
    real_run = SyncDaemon.run

    def run_leaving_one_unread(self: SyncDaemon, once: bool = False, stop=None) -> SyncReport:
        # Fault injection: the run is real; its report says one unit stayed skipped.
        report = real_run(self, once=once, stop=stop)
        report.units_unread = 1
        return report

    monkeypatch.setattr(SyncDaemon, "run", run_leaving_one_unread)
    assert main(["sync", "--config", str(config), "--once", "--no-progress"]) == 3
    assert "1 units were skipped and are still unread" in caplog.text


@pytest.mark.slow  # (a CLI process)
def test_budget_over_the_free_space_warns(tmp_path: Path) -> None:
    config = _config(tmp_path)
    result = _cli("sync", "--config", str(config), "--once", "--no-progress", "--set", "cache.max_bytes=1000PB")
    assert result.returncode == 0, result.stderr
    assert "cache.max_bytes=1.0EB is more than the cache's filesystem can hold" in result.stderr


@pytest.mark.slow  # (CLI processes)
def test_clear_refuses_without_yes_then_empties_the_cache(tmp_path: Path, capsys) -> None:
    config = _config(tmp_path)
    assert main(["sync", "--config", str(config), "--once", "--no-progress"]) == 0
    result = _cli("clear", "--config", str(config))  # no terminal: no prompt, no deletion
    assert result.returncode == 2 and "--yes" in result.stderr
    assert any((tmp_path / "cache" / "shards").iterdir())
    result = _cli("clear", "--config", str(config), "--yes")
    assert result.returncode == 0, result.stderr
    assert "shards" in result.stdout and "deleted" in result.stdout
    capsys.readouterr()
    assert main(["status", "--config", str(config), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["shards"], status["samples"], status["bytes"] - status["ledger_bytes"]) == (0, 0, 0)
    assert main(["sync", "--config", str(config), "--once", "--no-progress"]) == 0  # a fresh cache fills again
    capsys.readouterr()
    assert main(["status", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 3 * 64


def test_bytes_under_counts_every_file_below(tmp_path: Path) -> None:
    from epochcache.cache.layout import bytes_under

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "one").write_bytes(b"x" * 10)
    (tmp_path / "a" / "b" / "two").write_bytes(b"y" * 32)
    assert bytes_under(tmp_path) == 42 and bytes_under(tmp_path / 'absent') == 0


def test_verify_and_clear_show_no_bar_off_a_terminal_or_with_no_progress(tmp_path: Path, capsys) -> None:
    config = str(_config(tmp_path))
    assert main(["sync", "--config", config, "--once", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", "--config", config]) == 0  # stderr is no terminal here: no bar
    assert main(["verify", "--config", config, "--fix", "--no-progress"]) == 0
    assert main(["clear", "--config", config, "--yes", "--no-progress"]) == 0
    assert "%" not in capsys.readouterr().err


@pytest.mark.slow  # (a CLI process)
def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path: Path) -> None:
    """``epochcache status | head -1``: the reader gone, the command stops with 141 (128 + SIGPIPE),
    as a Unix tool does, without a BrokenPipeError traceback."""
    config = _config(tmp_path)
    assert main(["sync", "--config", str(config), "--once", "--no-progress"]) == 0
    reader, writer = os.pipe()
    os.close(reader)  # gone before a byte is written
    try:
        done = subprocess.run([sys.executable, "-m", "epochcache", "status", "--config", str(config)],
                              stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(writer)
    assert done.returncode == 141 and done.stderr == "", done.stderr
