"""Several weighted sources: the mix written follows the weights, each source keeps its own pass and
cursor, a restart resumes every source, bad weights are config errors, status shows every source."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import DaemonThread, wait_for

from epochcache import ConfigError, Ledger, SourceError, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.shards import open_shard
from epochcache.cli import main
from epochcache.config import Config, load_config
from epochcache.sources import KEY_COLUMN, open_source
from epochcache.sync.daemon import StopReason
from epochcache.sync.sampler import Cursor, Sampler

ROOMY = {"max_bytes": "50MB", "shard_bytes": "64KiB"}
GROUP_ROWS = 32  # small units: the mix can follow the weights to about two units' rows


def _write(root: Path, files: int, rows_per_file: int) -> str:
    """``files`` Parquet files of ``rows_per_file`` int64 ids in row groups of GROUP_ROWS rows."""
    fs = fsspec.filesystem("file")
    fs.makedirs(str(root), exist_ok=True)
    for number in range(files):
        ids = np.arange(number * rows_per_file, (number + 1) * rows_per_file, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), str(root / f"part-{number:03d}.parquet"), row_group_size=GROUP_ROWS)
    return str(root)


def _config(tmp_path: Path, sources: list[dict[str, Any]], **cache: Any) -> Config:
    return load_config(None, {"sources": sources, "cache": {"dir": str(tmp_path / "cache"), **ROOMY, **cache}})


def _ledger(config: Config) -> Ledger:
    return Ledger(CacheLayout(Path(config.cache.dir)).ledger)


def _run_until(config: Config, done: Callable[[Ledger, list[Any]], bool], once: bool = False) -> tuple[Any, list[Any]]:
    """Run the daemon until ``done(ledger, records published so far)`` holds after a publish."""
    stop, records, ledger = threading.Event(), [], _ledger(config)
    try:
        def on_publish(record: Any) -> None:
            records.append(record)
            if done(ledger, records):
                stop.set()

        report = SyncDaemon(config, progress=False, on_publish=on_publish).run(once=once, stop=stop)
    finally:
        ledger.close()
    return report, records


@pytest.mark.slow  # (2 s)
def test_the_mix_written_follows_the_weights_in_every_window_of_10000_samples(tmp_path: Path) -> None:
    small = _write(tmp_path / "a", files=8, rows_per_file=1024)  # 8192 rows, weight 1: ~6000 written
    big = _write(tmp_path / "b", files=20, rows_per_file=1024)  # 20480 rows, weight 3: ~18000 written
    config = _config(tmp_path, [{"url": small, "weight": 1, "name": "a"}, {"url": big, "weight": 3, "name": "b"}])
    report, records = _run_until(config, lambda _, records: sum(r.rows for r in records) >= 24_000)
    assert report.reason is StopReason.STOPPED
    layout = CacheLayout(Path(config.cache.dir))
    keys = pa.chunked_array([open_shard(layout.shards / r.filename)[KEY_COLUMN] for r in records])
    names = keys.to_pylist()
    assert all(key.startswith((small + "/", big + "/")) for key in names)
    from_a = np.array([key.startswith(small + "/") for key in names], dtype=np.int64)
    assert len(from_a) >= 24_000
    window = 10_000
    counts = np.concatenate([[0], np.cumsum(from_a)])
    shares = (counts[window:] - counts[:-window]) / window  # every window of consecutive samples written
    worst = float(np.abs(shares - 0.25).max())
    print(f"samples {len(from_a)}, windows {len(shares)}, worst share error {worst:.4%}")
    assert worst < 0.01, f"source a's share is off its weight by {worst:.2%} in some window of {window}"


def _write_arrow(root: Path, files: int, rows_per_file: int, batch_rows: int) -> str:
    """Arrow IPC files of record batches of ``batch_rows`` rows: units whose rows no metadata tells."""
    root.mkdir(parents=True)
    for number in range(files):
        table = pa.table({"id": np.arange(rows_per_file, dtype=np.int64)})
        with pa.ipc.new_file(str(root / f"part-{number:03d}.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=batch_rows)
    return str(root)


def test_units_without_row_counts_are_mixed_by_rows_estimated_from_bytes(tmp_path: Path) -> None:
    # Batches of 16 rows in one source and 64 in the other: counting units would give the first a
    # fifth of the rows, not the half its weight asks; rows estimated from unit bytes keep the weights.
    small = _write_arrow(tmp_path / "small", files=4, rows_per_file=1024, batch_rows=16)
    large = _write_arrow(tmp_path / "large", files=4, rows_per_file=1024, batch_rows=64)
    config = _config(tmp_path, [{"url": small, "weight": 1, "name": "small", "format": "arrow"},
                                {"url": large, "weight": 1, "name": "large", "format": "arrow"}])
    _, records = _run_until(config, lambda _, records: sum(r.rows for r in records) >= 4000)
    layout = CacheLayout(Path(config.cache.dir))
    keys = pa.chunked_array([open_shard(layout.shards / r.filename)[KEY_COLUMN] for r in records]).to_pylist()
    share = sum(key.startswith(small + "/") for key in keys) / len(keys)
    print(f"share of the 16-row batches {share:.3f} of {len(keys)} samples")
    assert abs(share - 0.5) < 0.03, share


def test_each_source_keeps_its_own_pass_and_status_shows_both(tmp_path: Path, capsys: Any) -> None:
    tiny = _write(tmp_path / "tiny", files=1, rows_per_file=4 * GROUP_ROWS)  # wraps after 4 units
    big = _write(tmp_path / "big", files=16, rows_per_file=1024)
    config = _config(tmp_path, [{"url": tiny, "weight": 1, "name": "tiny"}, {"url": big, "weight": 1, "name": "big"}])

    def tiny_wrapped(ledger: Ledger, _: list[Any]) -> bool:
        return ledger.daemon.cursor()["streams"]["tiny"]["pass"] >= 1

    report, records = _run_until(config, tiny_wrapped)
    assert report.reason is StopReason.STOPPED
    units = [unit for record in records for unit in record.units]
    assert len(units) == len(set(units)), "a wrapped source never reads again a unit still on its way"
    ledger = _ledger(config)
    cursor = ledger.daemon.cursor()
    ledger.close()
    assert cursor["streams"]["tiny"]["pass"] >= 1 and cursor["streams"]["big"]["pass"] == 0, cursor
    progress = cursor["progress"]
    tiny_pass = progress["tiny.pass"]
    assert tiny_pass >= 1 and progress["big.pass"] == 0 and progress["big.objects_total"] == 16
    assert all(isinstance(k, str) and (v is None or isinstance(v, int)) for k, v in progress.items())
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({"sources": [s.model_dump() for s in config.sources],
                                           "cache": {"dir": config.cache.dir, **ROOMY}}))
    assert main(["status", "--config", str(config_path)]) == 0
    shown = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in shown.splitlines() if line.startswith("  ")}
    assert rows["tiny"][:2] == ["pass", f"{tiny_pass}:"], shown
    assert rows["big"][:2] == ["pass", "0:"] and " ".join(rows["big"]).endswith("of 16 objects finished"), shown
    assert int(rows["big"][2]) > 0, "units cached this pass are counted though no object is finished yet"


def _walked_to(config: Config, index: int, saved: dict[str, int]) -> set[str]:
    """The unit keys that source ``index``'s order holds before its ``saved`` cursor."""
    source_config = config.sources[index]
    source = open_source(source_config)
    sampler = Sampler(lambda objs: [source.units(o) for o in objs], source.list_objects(), config.sampler.seed,
                      mix=config.sampler.mix_units)
    target, walked = Cursor.from_dict(saved), set()
    if target == Cursor():
        return walked
    for unit, after in sampler.walk(Cursor(target.pass_)):
        walked.add(unit.key)
        if after == target:
            return walked
    pytest.fail(f"cursor {saved} is not a position of source {source_config.name}'s order")


def test_a_restart_resumes_every_source_neither_repeating_nor_skipping(tmp_path: Path) -> None:
    one = _write(tmp_path / "one", files=4, rows_per_file=256)
    two = _write(tmp_path / "two", files=6, rows_per_file=256)
    config = _config(tmp_path, [{"url": one, "weight": 1, "name": "one"}, {"url": two, "weight": 2, "name": "two"}])
    first, records = _run_until(config, lambda _, records: len(records) >= 3)
    assert first.reason is StopReason.STOPPED
    before = [unit for record in records for unit in record.units]
    ledger = _ledger(config)
    saved = ledger.daemon.cursor()["streams"]
    ledger.close()
    assert saved["one"] != Cursor().to_dict() and saved["two"] != Cursor().to_dict(), saved
    for index, name, root in ((0, "one", one), (1, "two", two)):
        mine = {unit for unit in before if unit.startswith(root + "/")}
        assert _walked_to(config, index, saved[name]) == mine, f"{name}: its cursor marks exactly what it published"

    fetched: list[str] = []
    again = SyncDaemon(config, progress=False, on_fetch=lambda unit: fetched.append(unit.key)).run(once=True)
    assert again.reason is StopReason.EXHAUSTED
    ledger = _ledger(config)
    after = [unit for record in ledger.shards() for unit in record.units]
    ledger.close()
    everything = {f"{root}/part-{f:03d}.parquet#{g}" for root, files in ((one, 4), (two, 6))
                  for f in range(files) for g in range(256 // GROUP_ROWS)}
    assert not set(fetched) & set(before), "the restart fetched nothing the first run published"
    assert len(after) == len(set(after)) and set(after) == everything, "every unit of both sources, once"


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([{"url": "s3://b/a", "weight": 1}, {"url": "s3://b/b"}], "sources.1.weight is missing"),
        ([{"url": "s3://b/a", "weight": 0}], "sources.0.weight = 0: must be a finite number > 0"),
        ([{"url": "s3://b/a", "weight": -2.5}], "sources.0.weight = -2.5: must be a finite number > 0"),
        ([{"url": "s3://b/a", "weight": 1}, {"url": "s3://b/a", "weight": 2}], "sources share url"),
        ([{"url": "s3://b/a", "weight": 1, "name": "x"}, {"url": "s3://b/c", "weight": 1, "name": "x"}],
         "sources share name"),
        ([], "give a non-empty list of sources"),
    ],
)
def test_bad_sources_are_config_errors(tmp_path: Path, sources: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("+", r"\+")):
        _config(tmp_path, sources)


def test_source_is_shorthand_for_one_unnamed_source_of_weight_one(tmp_path: Path) -> None:
    config = load_config(None, {"source.url": "s3://b/a", "cache.dir": str(tmp_path)})
    assert [(s.url, s.name, s.weight) for s in config.sources] == [("s3://b/a", "", 1.0)]
    with pytest.raises(ConfigError, match="source.weight applies only to entries of a sources: list"):
        load_config(None, {"source.url": "s3://b/a", "source.weight": 2, "cache.dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"^override source\.format: source\.format = 'zip': "):
        load_config(None, {"source.url": "s3://b/a", "source.format": "zip", "cache.dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="either source: .* or sources: .*not both"):
        load_config(None, {"source.url": "s3://b/a", "sources": [{"url": "s3://b/c", "weight": 1}],
                           "cache.dir": str(tmp_path)})
    named = _config(tmp_path, [{"url": "s3://b/a", "weight": 1}, {"url": "s3://b/c", "weight": 3}])
    assert [(s.name, s.weight) for s in named.sources] == [("source0", 1.0), ("source1", 3.0)]


def test_config_yaml_documents_sources_with_an_example_that_loads(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "config.yaml").read_text(encoding="utf-8")
    lines = text.splitlines()
    start = lines.index("# sources:")
    example = [line[2:] for line in lines[start:] if line.startswith(("# sources:", "#   - "))]
    data = yaml.safe_load("\n".join(example))
    config = load_config(None, {**data, "cache.dir": str(tmp_path)}, env={})
    assert [(s.name, s.weight) for s in config.sources] == [("photos", 3.0), ("renders", 1.0)]
    assert "weight:" in text and "name:" in text


def test_a_continuous_sync_publishes_every_source_whole_before_it_idles(tmp_path: Path) -> None:
    one = _write(tmp_path / "one", files=2, rows_per_file=96)
    two = _write(tmp_path / "two", files=3, rows_per_file=96)
    config = _config(tmp_path, [{"url": one, "weight": 1, "name": "one"}, {"url": two, "weight": 1, "name": "two"}])
    runner = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)
    try:
        # Far less than a shard: only the flush before the walk pauses (all cached) can publish it.
        wait_for(lambda: ledger.usage().rows == 5 * 96, timeout=30)
    finally:
        ledger.close()
        report = runner.stop()
    assert report.units_published == 5 * 96 // GROUP_ROWS == report.units_fetched, "each unit read once"


def test_sources_with_other_columns_stop_with_a_message_naming_both(tmp_path: Path) -> None:
    ids = _write(tmp_path / "ids", files=1, rows_per_file=64)
    (tmp_path / "names").mkdir()
    pq.write_table(pa.table({"name": pa.array(["x"] * 64)}), str(tmp_path / "names" / "n.parquet"),
                   row_group_size=GROUP_ROWS)
    config = _config(tmp_path, [{"url": ids, "weight": 1, "name": "ids"},
                                {"url": str(tmp_path / "names"), "weight": 1, "name": "names"}])
    with pytest.raises(SourceError, match=r"source 'names'.* has columns \[name: string.*source 'ids'.*id: int64"):
        SyncDaemon(config, progress=False).run(once=True)


def test_two_s3_prefixes_each_complete_one_pass_once(
    s3: Any, bucket: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    for prefix, files in (("images", 2), ("text", 3)):
        for number in range(files):
            with s3.open(f"{bucket}/{prefix}/part-{number}.parquet", "wb") as f:
                pq.write_table(pa.table({"id": np.arange(64, dtype=np.int64)}), f, row_group_size=GROUP_ROWS)
    config = _config(tmp_path, [
        {"url": f"s3://{bucket}/images", "weight": 3, "name": "images", "storage_options": s3_options},
        {"url": f"s3://{bucket}/text", "weight": 1, "name": "text", "storage_options": s3_options},
    ])
    fetched: list[str] = []
    report = SyncDaemon(config, progress=False, on_fetch=lambda unit: fetched.append(unit.key)).run(once=True)
    assert report.reason is StopReason.EXHAUSTED and report.samples_published == 5 * 64
    assert len(fetched) == len(set(fetched)) == 10, "every row group of both prefixes read once"
    ledger = _ledger(config)
    cursor = ledger.daemon.cursor()
    ledger.close()
    assert cursor["streams"] == {"images": {"pass": 1, "group": 0, "step": 0},
                                 "text": {"pass": 1, "group": 0, "step": 0}}, "each source ended its own pass 0"


@pytest.mark.slow
def test_kill_9_of_a_two_source_daemon_neither_repeats_nor_skips(tmp_path: Path) -> None:
    one = _write(tmp_path / "one", files=4, rows_per_file=512)
    two = _write(tmp_path / "two", files=8, rows_per_file=512)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({
        "sources": [{"url": one, "weight": 1, "name": "one"}, {"url": two, "weight": 2, "name": "two"}],
        "cache": {"dir": str(tmp_path / "cache"), **ROOMY},
        "sampler": {"max_bytes_per_s": "150KB", "concurrency": 2},  # slow: the kills land mid-pass
    }))
    ledger = Ledger(CacheLayout.create(tmp_path / "cache").ledger)
    rng = random.Random(3)
    try:
        for life in range(6):
            proc = subprocess.Popen([sys.executable, "-m", "epochcache", "sync", "-c", str(config_path),
                                     "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                wait_for(lambda p=proc: (ledger.daemon.status() or {}).get("pid") == p.pid or p.poll() is not None)
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                time.sleep(rng.uniform(0.2, 0.8))  # the random moment of the kill, not a synchronisation
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                if proc.stderr:
                    proc.stderr.close()
            units = [unit for record in ledger.shards() for unit in record.units]
            assert len(units) == len(set(units)), f"life {life}: a unit is cached twice"
        streams = ledger.daemon.cursor()["streams"]
        assert streams["one"]["pass"] == streams["two"]["pass"] == 0, "the kills land before a pass ends"
        cached_before = ledger.usage().rows
        assert 0 < cached_before < 12 * 512, cached_before
        finish = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config_path), "--once",
                                 "--no-progress", "--set", "sampler.max_bytes_per_s=null"],
                                capture_output=True, text=True, timeout=120)
        assert finish.returncode == 0, finish.stderr
        layout = CacheLayout(tmp_path / "cache")
        keys = [key for r in ledger.shards() for key in open_shard(layout.shards / r.filename)[KEY_COLUMN].to_pylist()]
    finally:
        ledger.close()
    assert len(keys) == len(set(keys)) == 12 * 512, "every sample of both sources cached exactly once"
