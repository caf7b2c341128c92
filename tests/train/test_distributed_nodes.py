"""Nodes split one remote: two simulated nodes, each with its own cache dir and its own
``epochcache sync --once`` process, on one S3 remote (moto on 127.0.0.1). Together they fetch every
sample once; daemons that would fetch the same samples are refused by the loaders as they start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import cached_ids, write_parquet_dataset
from dist_launch import launch

FILES, ROWS = 8, 40


def _sync_nodes(tmp_path: Path, url: str, endpoint: str, splits: list[tuple[int, int]]) -> list[str]:
    """One ``epochcache sync --once`` per ``(node_rank, num_nodes)``, run at the same time; their cache dirs."""
    caches, procs = [], []
    for node, (node_rank, nodes) in enumerate(splits):
        cache = str(tmp_path / f"cache{node}")
        config = tmp_path / f"node{node}.yaml"
        config.write_text(yaml.safe_dump({
            "source": {"url": url, "storage_options": {"key": "testing", "secret": "testing",
                                                       "client_kwargs": {"endpoint_url": endpoint}}},
            "cache": {"dir": cache, "max_bytes": "20MB", "shard_bytes": "64KiB"},
            "sampler": {"node_rank": node_rank, "num_nodes": nodes},
        }))
        caches.append(cache)
        procs.append(subprocess.Popen([sys.executable, "-m", "epochcache", "sync", "-c", str(config), "--once",
                                       "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        output = proc.communicate(timeout=120)[0].decode(errors="replace")
        assert proc.returncode == 0, output
    return caches


@pytest.mark.slow  # (node processes: 3-4 s)
def test_two_nodes_daemons_fetch_the_remote_once_between_them(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path,
) -> None:
    write_parquet_dataset(s3, f"{bucket}/data", FILES, ROWS, 20)
    caches = _sync_nodes(tmp_path, f"s3://{bucket}/data", s3_endpoint, [(0, 2), (1, 2)])
    first, second = (cached_ids(cache) for cache in caches)
    assert first and second, "each node fetched its share"
    assert not set(first) & set(second), "no sample fetched by both nodes"
    assert sorted(first + second) == list(range(FILES * ROWS)), "together they cover the remote, each sample once"


@pytest.mark.slow  # (several seconds each: run by .ci/run, out of plain pytest's 3 minutes)
@pytest.mark.parametrize("splits", [[(0, 2), (0, 2)], [(0, 2), (1, 3)]], ids=["same_node_rank", "num_nodes_differ"])
def test_nodes_whose_daemons_would_fetch_the_same_samples_are_refused(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path, splits: list[tuple[int, int]],
) -> None:
    write_parquet_dataset(s3, f"{bucket}/data", FILES, ROWS, 20)
    caches = _sync_nodes(tmp_path, f"s3://{bucket}/data", s3_endpoint, splits)
    records = launch({"caches": {"0": caches[0], "1": caches[1]}, "loader": {"batch_size": 16}, "epochs": 1},
                     2, 1, tmp_path / "run")
    for rank in (0, 1):
        error = records[rank].get("error", "")
        assert f"the nodes' daemons do not split s3://{bucket}/data" in error, records[rank]
        assert "give each node's `epochcache sync` its own sampler.node_rank" in error
        assert f"{caches[0]} has sampler.node_rank={splits[0][0]}, num_nodes={splits[0][1]}" in error
