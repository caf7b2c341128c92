"""A moto S3 server on loopback in a child process (so it does not share the benchmark's GIL), for
the benchmarks that read through S3."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Set
from contextlib import contextmanager

_SERVER = (
    "import os, sys; cpus = sys.argv[1:]\n"
    "if cpus: os.sched_setaffinity(0, {int(cpu) for cpu in cpus})  # before any thread starts\n"
    "from moto.server import ThreadedMotoServer; import logging\n"
    "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
    "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0); s.start()\n"
    "print('PORT', s.get_host_and_port()[1], flush=True); sys.stdin.read()\n"
)


@contextmanager
def moto_server(cpus: Set[int] = frozenset()) -> Iterator[str]:
    """Yields the server's endpoint URL (``http://127.0.0.1:<port>``); the server ends on exit. ``cpus``:
    the CPUs the server runs on (Linux), none for any."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER, *map(str, sorted(cpus))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        lines = iter(server.stdout.readline, "")  # type: ignore[union-attr]
        port = next(line.split()[1] for line in lines if line.startswith("PORT "))
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()
