"""Starts the ranks of a simulated torch.distributed job on 127.0.0.1 (gloo), as torchrun would.

Each rank is a process running ``tests/dist_rank.py`` with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT), without torchrun's own start-up cost.
Out: each rank's ``rank<R>.json`` record, or the rank's exit code if it wrote none.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RANK_SCRIPT = Path(__file__).parents[1] / "dist_rank.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(plan: dict[str, Any], nodes: int, per_node: int, out: Path, timeout_s: float = 120) -> dict[int, Any]:
    """Run ``nodes`` x ``per_node`` ranks on ``plan`` (see ``tests/dist_rank.py``); wait for all of
    them within ``timeout_s`` (a hang kills them and fails the test). Returns each rank's record, or
    ``{"exit": code}`` for a rank that wrote none."""
    out.mkdir(exist_ok=True)
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan))
    port, world = free_port(), nodes * per_node
    procs = {}
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": "1"}
        procs[rank] = subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(plan_path), str(out)], env=env,
                                       start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    outputs = {}
    try:
        for rank, proc in procs.items():
            outputs[rank] = proc.communicate(timeout=timeout_s)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the distributed ranks did not finish within {timeout_s}s (a rank hung)")
    records: dict[int, Any] = {}
    for rank, proc in procs.items():
        path = out / f"rank{rank}.json"
        records[rank] = json.loads(path.read_text()) if path.exists() else {"exit": proc.returncode,
                                                                             "output": outputs[rank][-3000:]}
    return records
