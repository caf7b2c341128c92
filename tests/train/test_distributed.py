"""torch.distributed: two torchrun launches on 127.0.0.1 simulate 2 nodes x 2 processes (gloo).

Each simulated node has its own cache dir, synced by the real daemon from its own Parquet dataset
(node partition is the sampler's job); the nodes hold different numbers of samples, so equal batch
counts across all ranks are something the loaders must agree on, not an accident of equal data.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import make_table

from epochcache import Ledger, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.config import load_config
from epochcache.errors import LoaderError
from epochcache.train.distributed import check_node_splits

EPOCHS = 3
TIMEOUT_S = 150
NODES = {0: (0, 3, 100), 1: (10_000, 2, 90)}  # node -> (first id, files, rows per file)


def _node_cache(root: Path, node: int) -> Path:
    start, files, rows = NODES[node]
    remote = root / f"remote{node}"
    remote.mkdir()
    for number in range(files):
        pq.write_table(make_table(rows, start + number * rows), remote / f"part-{number}.parquet", row_group_size=30)
    cache = root / f"cache{node}"
    config = load_config(None, {"source.url": str(remote), "cache.dir": str(cache), "cache.max_bytes": "20MB",
                                "cache.shard_bytes": "64KiB"})
    SyncDaemon(config, progress=False).run(once=True)
    return cache


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(node: int, port: int, cache: Path, out: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
        str(Path(__file__).parents[1] / "dist_train.py"), str(cache), str(out), str(EPOCHS),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(procs: list[subprocess.Popen[bytes]]) -> list[str]:
    """Wait for every launch within the timeout; a hang kills them all and fails the test."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"distributed training did not finish within {TIMEOUT_S}s (a rank hung)")
    return outputs


@pytest.mark.slow
def test_two_nodes_two_ranks_each_equal_batches_disjoint_samples(tmp_path: Path) -> None:
    caches = {node: _node_cache(tmp_path, node) for node in NODES}
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    procs = [_launch(node, port, caches[node], out) for node in NODES]
    outputs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    for epoch in range(EPOCHS):
        counts = {r: len(ranks[r][epoch]["ids"]) for r in ranks}
        batches = {ranks[r][epoch]["batches"] for r in ranks}
        # the smaller node holds 180 samples: 90 per rank, 6 batches of 16; the larger node stops there too
        assert batches == {6}, batches
        assert all(c <= 6 * 16 for c in counts.values())
        for node, node_ranks in ((0, (0, 1)), (1, (2, 3))):
            first, files, rows = NODES[node]
            a, b = (ranks[r][epoch] for r in node_ranks)
            assert a["snapshot"] == b["snapshot"], "ranks of a node read one agreed snapshot"
            assert not set(a["ids"]) & set(b["ids"]), f"node {node} epoch {epoch}: ranks overlap"
            assert all(first <= i < first + files * rows for i in a["ids"] + b["ids"])
    assert ranks[0][0]["ids"] != ranks[0][1]["ids"], "each epoch draws a new order"
    for node, cache in caches.items():
        ledger = Ledger(CacheLayout(cache).ledger)
        uses = {r.uses for r in ledger.shards()}
        ledger.close()
        # once per epoch, whatever the node's ranks (the next epoch, prepared ahead before the loaders
        # closed, may count one more); a use per rank would give twice that
        assert uses <= {EPOCHS, EPOCHS + 1} and uses, f"node {node}: uses {uses} after {EPOCHS} epochs"


def test_node_splits_are_refused_only_where_two_nodes_would_fetch_one_sample() -> None:
    a, b, c = ("h1", "/c"), ("h2", "/c"), ("h3", "/c")
    assert check_node_splits({a: [("s3://x", 0, 0, 2)], b: [("s3://x", 0, 1, 2)]}) == []  # a proper split
    assert check_node_splits({a: [("s3://x", 0, 0, 1)], b: [("s3://y", 0, 0, 1)]}) == []  # different remotes
    # b's daemon has not listed yet: nothing to compare, and b may fetch share 1
    assert check_node_splits({a: [("s3://x", 0, 0, 2)], b: []}) == []
    for wrong, why in (
        ({a: [("s3://x", 0, 0, 1)], b: [("s3://x", 0, 0, 1)]}, "h2:/c has sampler.node_rank=0, num_nodes=1"),
        ({a: [("s3://x", 0, 0, 2)], b: [("s3://x", 0, 1, 3)]}, "h2:/c has sampler.node_rank=1, num_nodes=3"),
        ({a: [("s3://x", 0, 0, 2)], b: [("s3://x", 5, 1, 2)]}, "h2:/c has sampler.node_rank=1, num_nodes=2, seed=5"),
        ({a: [("s3://x", 0, 0, 3)], b: [("s3://x", 0, 1, 3)], c: [("s3://x", 0, 1, 3)]}, "h3:/c"),
    ):
        with pytest.raises(LoaderError, match="do not split s3://x") as caught:
            check_node_splits(wrong)
        assert why in str(caught.value)


def test_shares_that_no_node_of_the_job_fetches_are_warned_of() -> None:
    a, b = ("h1", "/c"), ("h2", "/c")
    (two_of_three,) = check_node_splits({a: [("s3://x", 0, 0, 3)], b: [("s3://x", 0, 2, 3)]})
    assert "sampler.num_nodes=3" in two_of_three and "share(s) 1 (1/3 of the remote)" in two_of_three
    (alone,) = check_node_splits({a: [("s3://x", 0, 1, 2)]})
    assert "share(s) 0 (1/2 of the remote)" in alone
