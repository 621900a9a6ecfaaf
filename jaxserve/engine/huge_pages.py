"""The CPU backend's weights and KV cache on transparent huge pages (Linux).

XLA's CPU buffers are plain heap memory on 4 KiB pages. The MoE and attention kernels read
weights and cache blocks with strides of a few KiB (an expert's rows, a request's blocks),
so each stride is a page and a TLB miss when the data comes from memory. Most distributions
set THP to `madvise` (/sys/kernel/mm/transparent_hugepage/enabled), so the heap never gets
huge pages unless asked. `advise_huge_pages` asks for the arrays that live for the whole
run: madvise(MADV_HUGEPAGE) on the 2 MiB-aligned inside of each buffer, then MADV_COLLAPSE
(Linux >= 6.1) to back it with huge pages now rather than when khugepaged gets to it.
Partial pages at a buffer's ends are left alone (they may hold other allocations).

Measured on the 2-core AMD EPYC test VM: `scripts/native/bench_moe_kernel.cc` with
BENCH_HUGEPAGES=1 ran the MoE kernel 1.04-1.20x faster; glibc's malloc on huge pages for
the whole engine (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) gave the random Qwen3-MoE at
batch 128 1.05x (`scripts/compare_hf.py --baseline-python`, 3 interleaved runs).

A no-op off Linux, for non-CPU devices, where THP is `never`, or with JAXSERVE_HUGE_PAGES=0
(for A/B runs). Failures (EINVAL on old kernels, EAGAIN when no huge page is free) leave
the memory as it was: this is a speed hint, never an error.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable

import jax

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base page) PMD size
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
_MADV_COLLAPSE = 25
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _enabled() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("JAXSERVE_HUGE_PAGES") == "0":
        return False
    try:
        with open(_THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _cpu_buffers(arrays: Iterable[jax.Array]) -> Iterable[tuple[int, int]]:
    """(address, bytes) of each CPU buffer of `arrays` (every addressable shard)."""
    for a in arrays:
        for shard in getattr(a, "addressable_shards", ()):
            if shard.device.platform != "cpu" or shard.data.nbytes < HUGE_PAGE:
                continue
            yield shard.data.unsafe_buffer_pointer(), shard.data.nbytes


def advise_huge_pages(arrays: Iterable[jax.Array]) -> int:
    """Back the 2 MiB-aligned inside of every CPU buffer of `arrays` with huge pages.

    arrays: any jax.Arrays (a pytree's leaves); non-CPU shards and buffers under 2 MiB
    are skipped. The buffers must stay where they are for the hint to last: parameters,
    and the KV cache (donated to each step, so XLA updates it in place).

    Returns the bytes now backed by huge pages (0 where disabled or unsupported).
    """
    if not _enabled():
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for address, nbytes in _cpu_buffers(arrays):
        start = -(-address // HUGE_PAGE) * HUGE_PAGE
        end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            continue
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
        else:  # EAGAIN/ENOMEM: no free huge page now (fragmented memory); khugepaged may later
            log.debug("huge pages: MADV_COLLAPSE refused (%s)", os.strerror(ctypes.get_errno()))
    log.debug("huge pages: %.1f MiB of weights and KV cache", done / 2**20)
    return done
