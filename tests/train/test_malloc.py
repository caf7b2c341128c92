"""glibc's thresholds fixed for batch-sized buffers (epochcache.train.malloc), with the C library injected."""

from __future__ import annotations

import ctypes

import pytest

from epochcache.train.malloc import keep_large_allocations


class _Libc:
    """A C library that records its mallopt calls (and refuses them when told to)."""

    def __init__(self, accepts: bool = True):
        self.calls: list[tuple[int, int]] = []
        self._accepts = accepts

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return int(self._accepts)


def test_the_mmap_threshold_and_the_trim_threshold_are_fixed_at_glibcs_ceilings() -> None:
    libc = _Libc()
    assert keep_large_allocations(libc)
    assert libc.calls == [(-3, 32 << 20), (-1, 64 << 20)], "M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD twice that"


def test_a_c_library_without_mallopt_or_refusing_it_is_left_as_it_is() -> None:
    assert not keep_large_allocations(object())
    assert not keep_large_allocations(_Libc(accepts=False))


def test_this_processes_glibc_takes_the_settings() -> None:
    if getattr(ctypes.CDLL(None), "mallopt", None) is None:
        pytest.skip("not glibc: the loader leaves the allocator alone")
    assert keep_large_allocations()
