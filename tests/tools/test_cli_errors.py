"""What the epochcache command does with a newcomer's wrong input: one line on stderr naming the bad
value and the fix, exit code 2, no traceback, and nothing created where nothing was meant to be."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import pytest
import yaml
from conftest import write_parquet_dataset

from epochcache.cli import main


def _config(tmp_path: Path, **source: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "source": {"url": "remote", **source},
        "cache": {"dir": "cache", "max_bytes": "5MB", "shard_bytes": "100KB"},
    }))
    return path


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    """The single stderr line of a failed command."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_unknown_url_scheme_is_refused_at_load_with_a_guess(tmp_path: Path, capsys) -> None:
    config = _config(tmp_path, url="s4://bucket/x")
    assert main(["sync", "-c", str(config), "--once", "--no-progress"]) == 2
    line = _error(capsys)
    assert "source.url = 's4://bucket/x'" in line and "scheme 's4' (did you mean 's3'?)" in line, line
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("command", [["verify"], ["verify", "--fix"], ["gc"]])
@pytest.mark.parametrize(("make", "state"), [
    pytest.param(lambda path: None, "does not exist", id="missing"),
    pytest.param(lambda path: path.write_text("x"), "is a file, not a folder", id="file"),
    pytest.param(lambda path: path.mkdir(), "holds no epochcache cache", id="empty"),
])
def test_a_cache_dir_without_a_cache_is_refused_and_left_as_it_was(
    tmp_path: Path, capsys, command: list[str], make, state: str
) -> None:
    make(tmp_path / "cache")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main([*command, "-c", str(_config(tmp_path))]) == 2
    line = _error(capsys)
    assert f"cache.dir '{tmp_path / 'cache'}' {state}: check cache.dir" in line, line
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name != "config.yaml") == before


@pytest.mark.parametrize("command", [["status"], ["clear", "--yes"], ["plot"]])
def test_a_file_as_cache_dir_is_named_a_file(tmp_path: Path, capsys, command: list[str]) -> None:
    (tmp_path / "cache").write_text("x")
    assert main([*command, "-c", str(_config(tmp_path))]) == 2
    assert f"cache.dir '{tmp_path / 'cache'}' is a file, not a folder: check cache.dir" in _error(capsys)
    assert (tmp_path / "cache").read_text() == "x"


def test_verify_fix_rebuilds_a_lost_ledger_from_the_shards(tmp_path: Path, capsys) -> None:
    write_parquet_dataset(fsspec.filesystem("file"), str(tmp_path / "remote"), files=1, rows_per_file=64,
                          rows_per_group=32)
    config = str(_config(tmp_path))
    assert main(["sync", "-c", config, "--once", "--no-progress"]) == 0
    shutil.rmtree(tmp_path / "cache" / "ledger")
    capsys.readouterr()  # the sync's log lines
    assert main(["verify", "-c", config]) == 2  # nothing to read without --fix
    assert "holds no epochcache cache" in _error(capsys)
    assert main(["verify", "--fix", "-c", config]) == 0
    assert "adopted (fixed)" in capsys.readouterr().out


@pytest.mark.parametrize(("override", "shown"), [
    ("cache.max_bytes=lots", "cache.max_bytes = 'lots': not a size: give a number of bytes > 0 or a size such as 20GB"),
    ("cache.max_bytes=-5", "cache.max_bytes = -5: not a size: give a number of bytes > 0"),
    ("cache.shard_bytes=5XB", "could not interpret byte unit: XB: units are B, KB, MB"),
    ("cache.low_watermark=2", "cache.low_watermark = 2: Input should be less than or equal to 1 or 'auto'"),
    ("sampler.mix_units=0", "sampler.mix_units = 0: Input should be greater than or equal to 1 or 'auto'"),
    ("cache.max-bytes=5GB", "cache.max-bytes: unknown key; valid keys here: dir, eviction,"),
    ("cache=5", "cache = 5: must be a section of keys (dir, eviction, footer_bytes, low_watermark,"),
    ("source.weight=2", "--set source.weight=2: (top level): source.weight applies only to entries of a sources:"),
    ("cache.max_bytes", "--set 'cache.max_bytes' is not of the form section.name=value, e.g. --set cache.max_bytes"),
])
def test_bad_values_name_the_value_and_the_fix(tmp_path: Path, capsys, override: str, shown: str) -> None:
    assert main(["status", "-c", str(_config(tmp_path)), "--set", override]) == 2
    line = _error(capsys)
    assert shown in line and "***" not in line, line


def test_without_config_yaml_here_the_error_says_to_pass_config(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 2
    assert f"no config.yaml in the current folder ({tmp_path}): give the config file with --config PATH" in _error(
        capsys)


def test_a_key_written_twice_is_refused_with_its_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("source:\n  url: remote\ncache:\n  dir: cache\n  max_bytes: 5MB\ncache:\n  shard_bytes: 100KB\n")
    assert main(["status", "-c", str(path)]) == 2
    line = _error(capsys)
    assert f"{path}: line 6 is not valid YAML: key 'cache' is written twice in one section: keep one" in line, line


def test_a_config_that_is_not_text_is_one_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert main(["status", "-c", str(path)]) == 2
    assert f"config file '{path}' is not UTF-8 text (byte 0)" in _error(capsys)


@pytest.mark.parametrize(("args", "shown"), [
    (["--epochs", "0", "--samples", "200"], "--epochs 0: the demo trains at least one epoch; give --epochs 1 or more"),
    (["--samples", "100"], "--samples 100 is too few for the demo's cache (half the remote) to hold two shards: "
                           "give --samples 107 or more"),
])
def test_demo_refuses_arguments_it_cannot_run_with(tmp_path: Path, capsys, args: list[str], shown: str) -> None:
    assert main(["demo", "--dir", str(tmp_path / "demo"), *args]) == 2
    assert shown in _error(capsys)
    assert not (tmp_path / "demo").exists()


def test_demo_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "demo").write_text("x")
    assert main(["demo", "--dir", str(tmp_path / "demo"), "--epochs", "1", "--samples", "200"]) == 2
    assert f"--dir '{tmp_path / 'demo'}': cannot create the demo folder (File exists)" in _error(capsys)
