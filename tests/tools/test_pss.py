"""PSS by kind: mapping a file's pages shows as file-backed PSS, filling a buffer as anonymous PSS."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from epochcache.tools.pss import process_pss, tree_pss, tree_pss_bytes

SIZE = 32 * 2**20


def test_kinds_add_up_to_the_total() -> None:
    pss = tree_pss()
    assert pss.total > 0
    # each kind is rounded to kB apart in the kernel's sums: allow a page per kind
    assert abs(pss.anon + pss.file + pss.shmem - pss.total) <= 3 * 4096
    assert tree_pss_bytes() >= pss.anon


def test_mapped_file_pages_count_as_file_and_a_filled_buffer_as_anon(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes())
    before = process_pss(os.getpid())
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        total = int(view[:: mmap.PAGESIZE].sum())  # touch every page
        mapped_pss = process_pss(os.getpid())
        del view
    assert total > 0
    assert mapped_pss.file - before.file > SIZE * 0.9
    buffer = np.ones(SIZE, np.uint8)  # written: every page is the process's own
    filled = process_pss(os.getpid())
    assert filled.anon - mapped_pss.anon > SIZE * 0.9
    assert int(buffer[::4096].sum()) == SIZE // 4096


def test_a_process_that_is_gone_counts_nothing() -> None:
    assert process_pss(2**22 + 7).total == 0
