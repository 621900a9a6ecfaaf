"""`engine.huge_pages`: long-lived CPU buffers backed by transparent huge pages, as the
kernel reports them in /proc/self/smaps (the oracle), and nothing done when switched off."""

from __future__ import annotations

import ctypes
import errno
import sys

import jax
import numpy as np
import pytest

from jaxserve.engine import huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")


def _huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of the mappings inside [start, end), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: lo-hi perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo >= start and hi <= end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _aligned_inside(a: jax.Array) -> tuple[int, int]:
    address = a.addressable_shards[0].data.unsafe_buffer_pointer()
    page = huge_pages.HUGE_PAGE
    return -(-address // page) * page, (address + a.nbytes) // page * page


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return "[never]"


def _host_can_collapse() -> int:
    """0 if the kernel backs a fresh 2 MiB-aligned region with a huge page on MADV_COLLAPSE
    now, else the errno. A VM whose memory is fragmented (this kernel may not compact it)
    answers EAGAIN/ENOMEM for a while: a state of the host, not of jaxserve."""
    page = huge_pages.HUGE_PAGE
    region = np.ones(2 * page, np.uint8)  # populated: MADV_COLLAPSE acts on touched memory
    start = -(-region.ctypes.data // page) * page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for advice in (huge_pages._MADV_HUGEPAGE, huge_pages._MADV_COLLAPSE):
        if libc.madvise(start, page, advice) != 0:
            return ctypes.get_errno()
    return 0


def test_a_large_buffer_is_backed_by_huge_pages(monkeypatch):
    monkeypatch.delenv("JAXSERVE_HUGE_PAGES", raising=False)
    if "[never]" not in _thp_mode():
        err = _host_can_collapse()
        if err in (errno.EAGAIN, errno.ENOMEM):
            pytest.skip(f"the kernel has no free huge page now ({errno.errorcode[err]})")
    x = jax.device_put(np.arange(6 << 20, dtype=np.float32))  # 24 MiB
    small = jax.device_put(np.ones(1000, np.float32))  # under 2 MiB: skipped
    start, end = _aligned_inside(x)
    done = huge_pages.advise_huge_pages([x, small])
    if "[never]" in _thp_mode():
        assert done == 0
        return
    assert done == end - start >= 20 << 20  # the whole aligned inside of the buffer
    assert _huge_bytes_in(start, end) == done  # as the kernel reports it
    np.testing.assert_array_equal(np.asarray(x), np.arange(6 << 20, dtype=np.float32))


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_HUGE_PAGES", "0")
    x = jax.device_put(np.ones(6 << 20, np.float32))
    start, end = _aligned_inside(x)
    assert huge_pages.advise_huge_pages([x]) == 0
    if "[madvise]" in _thp_mode():  # with `always` the kernel backs the heap anyway
        assert _huge_bytes_in(start, end) == 0
