"""Tests for epochcache.config: loading, merging, validating and reporting errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from epochcache.cache.ledger import LEDGER_RESERVE
from epochcache.cli import main
from epochcache.config import Config, load_config
from epochcache.errors import ConfigError


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as YAML to ``path`` and return the path."""
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def minimal(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    """A valid config.yaml in ``tmp_path`` with a source and a cache section, plus ``sections``."""
    data: dict[str, Any] = {
        "source": {"url": "s3://bucket/prefix/"},
        "cache": {"dir": str(tmp_path / "cache")},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return write_yaml(tmp_path / "config.yaml", data)


def test_load_config_reads_yaml_file(tmp_path: Path) -> None:
    path = minimal(
        tmp_path,
        cache={"max_bytes": "2GB", "shard_bytes": "1MB"},
        sampler={"seed": 7, "concurrency": 3},
        loader={"batch_size": 16, "columns": ["id"]},
    )
    config = load_config(path, env={})
    assert isinstance(config, Config)
    assert config.source.url == "s3://bucket/prefix/"
    assert config.cache.dir == str(tmp_path / "cache")
    assert config.cache.max_bytes == 2 * 10**9
    assert config.cache.shard_bytes == 10**6
    assert config.sampler.seed == 7
    assert config.sampler.concurrency == 3
    assert config.loader.batch_size == 16
    assert config.loader.columns == ["id"]
    # Untouched keys keep their defaults.
    assert config.loader.num_workers is None  # auto: chosen per loader (issue 5)
    assert config.cache.eviction == "fifo"


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_config(minimal(tmp_path), env={})
    with pytest.raises(Exception):
        config.cache.max_bytes = 1  # type: ignore[misc]
    assert config.cache.max_bytes == 10 * 10**9


def test_unknown_key_inside_section_names_dotted_path_and_valid_keys(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"max_byts": "1GB"})
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "cache.max_byts" in message
    for key in ("dir", "eviction", "max_bytes", "shard_bytes"):
        assert key in message
    assert "\n" not in message


def test_unknown_key_at_top_level_lists_sections(tmp_path: Path) -> None:
    path = minimal(tmp_path, samplr={"seed": 1})
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "samplr" in message
    for key in ("cache", "loader", "sampler", "source"):
        assert key in message


def test_unknown_key_via_override_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"loader\.batchsize"):
        load_config(minimal(tmp_path), overrides=["loader.batchsize=3"], env={})


@pytest.mark.parametrize(
    ("field", "text", "expected"),
    [
        ("shard_bytes", "64MB", 64_000_000),
        ("shard_bytes", "64MiB", 2**26),
        ("max_bytes", "3GB", 3 * 10**9),
        ("max_bytes", "2GiB", 2 * 2**30),
        ("shard_bytes", 1_048_576, 1_048_576),
    ],
)
def test_sizes_accept_decimal_and_binary_units(tmp_path: Path, field: str, text: Any, expected: int) -> None:
    path = minimal(tmp_path, cache={field: text})
    config = load_config(path, env={})
    assert int(getattr(config.cache, field)) == expected


def test_max_bytes_64mib_exact(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"max_bytes": "64MiB", "shard_bytes": "1MiB"})
    config = load_config(path, env={})
    assert config.cache.max_bytes == 2**26
    assert config.cache.shard_bytes == 2**20


def test_bad_size_string_names_key_and_value(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"max_bytes": "12 zorks"})
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "cache.max_bytes" in message
    assert "12 zorks" in message


def test_budget_must_hold_two_shards(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"max_bytes": "1MB", "shard_bytes": "1MB"})
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "cache.max_bytes" in message
    assert str(MINIMUM) in message  # the minimum budget it names
    assert "1000000" in message and "cache: " in message and "'dir'" not in message


MINIMUM = 2 * 1_000_000 + 2 * LEDGER_RESERVE  # two shards plus room for the ledger


def test_budget_at_the_minimum_is_accepted_and_one_byte_less_refused(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"max_bytes": MINIMUM, "shard_bytes": "1MB"})
    assert load_config(path, env={}).cache.max_bytes == MINIMUM
    path = minimal(tmp_path, cache={"max_bytes": MINIMUM - 1, "shard_bytes": "1MB"})
    with pytest.raises(ConfigError, match=str(MINIMUM)):
        load_config(path, env={})


@pytest.mark.parametrize(("max_bytes", "charge"), [
    ("10GB", 64 * 2**20),  # auto: max_bytes/64, at most 64MiB
    ("1GB", 15_625_000),
    ("70MB", 1_093_750),
    ("60MB", 0),  # under 1MiB: none
    (MINIMUM, 0),  # never what two shards and the ledger need
])
def test_the_footers_share_of_the_budget_is_set_apart(tmp_path: Path, max_bytes: str | int, charge: int) -> None:
    cache = load_config(minimal(tmp_path, cache={"max_bytes": max_bytes, "shard_bytes": "1MB"}), env={}).cache
    assert cache.footer_charge() == charge
    assert cache.shard_budget() == int(cache.max_bytes) - charge


def test_footer_bytes_given_are_checked_against_the_budget(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"max_bytes": "1GB", "footer_bytes": "16MiB"})
    assert load_config(path, env={}).cache.footer_charge() == 16 * 2**20
    assert load_config(minimal(tmp_path, cache={"footer_bytes": 0}), env={}).cache.footer_charge() == 0
    with pytest.raises(ConfigError, match=r"footer_bytes=100000 .* at least 1048576"):
        load_config(minimal(tmp_path, cache={"footer_bytes": "100KB"}), env={})
    path = minimal(tmp_path, cache={"max_bytes": MINIMUM, "shard_bytes": "1MB", "footer_bytes": "1MiB"})
    with pytest.raises(ConfigError, match=str(MINIMUM + 2**20)):
        load_config(path, env={})


def test_shard_bytes_below_64kib_refused(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"shard_bytes": "1KB"})
    with pytest.raises(ConfigError, match=r"cache\.shard_bytes"):
        load_config(path, env={})


def test_precedence_defaults_yaml_env_overrides(tmp_path: Path) -> None:
    path = minimal(tmp_path, cache={"max_bytes": "1GB", "shard_bytes": "1MB"}, sampler={"seed": 3})

    # Defaults under YAML.
    assert load_config(path, env={}).cache.max_bytes == 10**9
    assert load_config(path, env={}).sampler.concurrency == 8

    env = {"EPOCHCACHE_CACHE__MAX_BYTES": "2GB", "EPOCHCACHE_SAMPLER__CONCURRENCY": "4"}
    from_env = load_config(path, env=env)
    assert from_env.cache.max_bytes == 2 * 10**9  # env over YAML
    assert from_env.sampler.concurrency == 4  # env over defaults, typed like YAML
    assert from_env.sampler.seed == 3  # YAML kept where env says nothing

    from_strings = load_config(path, overrides=["cache.max_bytes=3GB"], env=env)
    assert from_strings.cache.max_bytes == 3 * 10**9  # override over env
    assert from_strings.sampler.concurrency == 4

    from_mapping = load_config(path, overrides={"cache.max_bytes": "4GB", "sampler.seed": 9}, env=env)
    assert from_mapping.cache.max_bytes == 4 * 10**9
    assert from_mapping.sampler.seed == 9


def test_env_ignores_names_without_section_separator(tmp_path: Path) -> None:
    path = minimal(tmp_path)
    config = load_config(path, env={"EPOCHCACHE_MAX_BYTES": "garbage", "OTHER__THING": "x"})
    assert config.cache.max_bytes == 10 * 10**9


def test_env_defaults_to_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPOCHCACHE_SAMPLER__SEED", "42")
    assert load_config(minimal(tmp_path)).sampler.seed == 42
    # An explicit env mapping replaces os.environ entirely.
    assert load_config(minimal(tmp_path), env={}).sampler.seed == 0


def test_override_values_are_typed_like_yaml(tmp_path: Path) -> None:
    config = load_config(
        minimal(tmp_path), overrides=["loader.shuffle=false", "loader.prepare_next_at=0.5"], env={}
    )
    assert config.loader.shuffle is False
    assert config.loader.prepare_next_at == 0.5


def test_relative_paths_resolve_against_yaml_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = write_yaml(
        conf_dir / "config.yaml",
        {"source": {"url": "data/remote"}, "cache": {"dir": "../cache"}},
    )
    monkeypatch.chdir(elsewhere)
    config = load_config(path, env={})
    assert config.source.url == str((conf_dir / "data" / "remote").resolve())
    assert config.cache.dir == str((tmp_path / "cache").resolve())

    # A relative config path given from another working directory means the same thing.
    monkeypatch.chdir(tmp_path)
    again = load_config(Path("conf") / "config.yaml", env={})
    assert again.source.url == config.source.url
    assert again.cache.dir == config.cache.dir


def test_urls_with_scheme_and_absolute_paths_stay_as_is(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "config.yaml",
        {"source": {"url": "s3://bucket/some/prefix/"}, "cache": {"dir": "/abs/cache/dir"}},
    )
    config = load_config(path, env={})
    assert config.source.url == "s3://bucket/some/prefix/"
    assert config.cache.dir == "/abs/cache/dir"


def test_invalid_yaml_reports_line_number(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("source:\n  url: s3://b/p\ncache:\n  dir: x\n   max_bytes: 1GB\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message
    assert "line 5" in message  # the over-indented max_bytes line
    assert "not valid YAML" in message
    assert "\n" not in message


def test_yaml_top_level_must_be_mapping(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("- just\n- a list\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path, env={})


def test_missing_file_is_config_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "nope.yaml" in str(info.value)


def test_missing_required_keys_named(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "config.yaml", {"source": {"url": "s3://b/p"}})
    with pytest.raises(ConfigError, match="cache"):
        load_config(path, env={})


@pytest.mark.parametrize("key", ["sampler.seed", "loader.seed"])
def test_negative_seed_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(minimal(tmp_path), overrides={key: -1}, env={})
    assert key in str(info.value)
    assert "-1" in str(info.value)


@pytest.mark.parametrize("item", ["nokey", "=3", "  =x"])
def test_malformed_override_refused(tmp_path: Path, item: str) -> None:
    with pytest.raises(ConfigError, match="section.name=value"):
        load_config(minimal(tmp_path), overrides=[item], env={})


def test_override_into_scalar_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a section"):
        load_config(minimal(tmp_path), overrides=["cache.dir.sub=1"], env={})


def test_defaults_only_with_overrides(tmp_path: Path) -> None:
    config = load_config(None, {"source.url": "s3://b/p", "cache.dir": str(tmp_path / "c")}, env={})
    assert config.sampler.seed == 0
    assert config.cache.dir == str(tmp_path / "c")


def test_cli_bad_config_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = minimal(tmp_path, cache={"max_byts": "1GB"})
    code = main(["status", "--config", str(bad)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("epochcache: error:")
    assert "cache.max_byts" in lines[0]
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_cli_missing_config_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["status", "--config", str(tmp_path / "absent.yaml")])
    captured = capsys.readouterr()
    assert code == 2
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("epochcache: error:")
    assert "Traceback" not in captured.err


def test_rate_cap_must_be_positive(tmp_path: Path) -> None:
    path = minimal(tmp_path, sampler={"max_bytes_per_s": 0})
    with pytest.raises(ConfigError, match=r"sampler\.max_bytes_per_s"):
        load_config(path, env={})


def test_objects_read_whole_must_fit_in_flight(tmp_path: Path) -> None:
    path = minimal(tmp_path, sampler={"max_inflight_bytes": "16MB", "whole_object_bytes": "2MB"})
    assert load_config(path, env={}).sampler.whole_object_bytes == 2 * 10**6  # 8 (mix_units) x 2MB = 16MB
    with pytest.raises(ConfigError, match=r"whole_object_bytes=2000001 times mix_units=8 exceeds max_inflight_bytes"):
        load_config(path, overrides=["sampler.whole_object_bytes=2000001"], env={})
    # the default (8MB) over a lower max_inflight_bytes is no error: open_source lowers it to what fits
    lowered = load_config(minimal(tmp_path, sampler={"max_inflight_bytes": "4MB"}), env={}).sampler
    assert (lowered.whole_object_bytes, lowered.max_inflight_bytes) == (8 * 2**20, 4 * 10**6)


def test_errors_name_the_origin_as_written(tmp_path: Path) -> None:
    path = minimal(tmp_path, sampler={"concurrency": 0})
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=["cache.max_bytes=lots"], env={"EPOCHCACHE_LOADER__BATCH_SIZE": "0"})
    parts = str(info.value).split("; ")
    assert any(p.startswith(f"{path}: sampler.concurrency = 0") for p in parts), parts
    assert any(p.startswith("--set cache.max_bytes=lots: cache.max_bytes = 'lots'") for p in parts), parts
    assert any(p.startswith("environment variable EPOCHCACHE_LOADER__BATCH_SIZE: loader.batch_size = 0")
               for p in parts), parts


def test_a_section_check_names_the_override_that_broke_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(minimal(tmp_path), env={"EPOCHCACHE_CACHE__MAX_BYTES": "1MB"})
    assert str(info.value).startswith("environment variable EPOCHCACHE_CACHE__MAX_BYTES: cache: max_bytes=")


def test_errors_never_echo_storage_options_secrets(tmp_path: Path) -> None:
    secrets = {"key": "AKIAEXAMPLE0001", "secret": "very-secret-0001", "token": "session-token-0001"}
    path = write_yaml(tmp_path / "config.yaml", {
        "sources": [{"url": "s3://b/x/", "storage_options": secrets}],  # no weight
        "cache": {"dir": str(tmp_path / "cache")},
    })
    for overrides in ([], ["source.storage_options.secret.sub=1"]):
        with pytest.raises(ConfigError) as info:
            load_config(path, overrides=overrides, env={})
        assert not any(value in str(info.value) for value in secrets.values()), str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(minimal(tmp_path), overrides=["source.storage_options=very-secret-0001"], env={})
    assert "source.storage_options" in str(info.value) and "very-secret-0001" not in str(info.value)
