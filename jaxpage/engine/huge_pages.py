"""Transparent huge pages for a CPU runner's weights.

A decode step streams every weight once, and on CPU it is bound by that read. With 4 KiB
pages the read pays a TLB miss every 4 KiB, and under a hypervisor (nested paging) each miss
walks two page tables: on the 2-core development VM a plain sequential read of 256 MiB (a C
loop) runs at 15 GB/s on one core and 24 on two with 4 KiB pages, 27 and 33.5 with 2 MiB ones
(NumPy asks for huge pages for its large arrays: the read bandwidth the benchmarks measure with
it is the second kind). XLA:CPU allocates its buffers with malloc, in 4 KiB pages unless the
system's THP setting is "always" (the common default is "madvise"), so the
runner asks Linux to back its weight buffers with huge pages once they are placed: `advise`
marks each buffer's range MADV_HUGEPAGE and collapses it into huge pages now (MADV_COLLAPSE,
Linux 6.1+; older kernels leave the collapsing to khugepaged, in the background).

The range advised is each buffer widened to the 2 MiB boundaries around it, clipped to the
mapping it lies in: a buffer smaller than 2 MiB (most of a small model's) gets a huge page only
together with its neighbours in the heap, whose contents a collapse keeps as they are. Best
effort: anywhere this fails (no THP, another OS, an old kernel, no huge page free) the buffers
keep their pages and nothing else changes. `JAXPAGE_CPU_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
from collections.abc import Iterable
from typing import Any

import jax

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def enabled() -> bool:
    """Whether `advise` does anything here: Linux, and not turned off by the environment."""
    return sys.platform.startswith("linux") and os.environ.get("JAXPAGE_CPU_HUGE_PAGES", "1") != "0"


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def _mappings() -> tuple[list[int], list[int]]:
    """The process's mappings (/proc/self/maps) as sorted start and end addresses."""
    starts, ends = [], []
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = line.split(None, 1)[0].split("-")
            starts.append(int(start, 16))
            ends.append(int(end, 16))
    return starts, ends


def host_buffers(arrays: Iterable[Any]) -> list[tuple[int, int]]:
    """(address, bytes) of each CPU-resident buffer of `arrays` (every addressable shard)."""
    buffers = []
    for array in arrays:
        if not isinstance(array, jax.Array):
            continue
        for shard in array.addressable_shards:
            if shard.device.platform != "cpu" or shard.data.nbytes == 0:
                continue
            buffers.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return buffers


def advise(arrays: Iterable[Any]) -> int:
    """Back the CPU buffers of `arrays` with transparent huge pages (see the module docstring);
    returns the bytes of the 2 MiB-aligned ranges Linux collapsed into huge pages now (0 where
    it could not, or when not `enabled()`)."""
    if not enabled():
        return 0
    buffers = host_buffers(arrays)
    if not buffers:
        return 0
    try:
        madvise = _madvise()
        starts, ends = _mappings()
    except (OSError, AttributeError, ValueError):
        return 0
    ranges = set()  # buffers in one huge page share its range
    for address, nbytes in buffers:
        # the mappings holding the buffer's first and last bytes: one, or a run of adjacent
        # ones (an earlier MADV_HUGEPAGE splits the heap's mapping where its range ends)
        i = bisect.bisect_right(starts, address) - 1
        j = bisect.bisect_right(starts, address + nbytes - 1) - 1
        if i < 0 or ends[j] < address + nbytes or any(
                ends[m] != starts[m + 1] for m in range(i, j)):
            continue  # not in mapped memory, as far as /proc/self/maps says: leave it
        lo = max(starts[i], address // HUGE_PAGE * HUGE_PAGE)
        hi = min(ends[j], -(-(address + nbytes) // HUGE_PAGE) * HUGE_PAGE)
        ranges.add((lo, hi))
    collapsed = 0
    for lo, hi in sorted(ranges):
        madvise(lo, hi - lo, MADV_HUGEPAGE)
        # only whole huge pages collapse: the aligned part of the range, a page at a time (one
        # that cannot, e.g. for want of a free huge page, fails alone)
        first, last = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
        for page in range(first, last, HUGE_PAGE):
            if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE
    return collapsed
