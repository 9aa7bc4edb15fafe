"""Transparent huge pages for a CPU runner's weights and KV pool.

A decode step streams every weight once, and on CPU it is bound by that read. With 4 KiB
pages the read pays a TLB miss every 4 KiB, and under a hypervisor (nested paging) each miss
walks two page tables: on a 2-core AMD EPYC (Zen 4) virtual machine a plain sequential read
of 256 MiB (a C loop) runs at 15 GB/s on one core and 24 on two with 4 KiB pages, 27 and 33.5
with 2 MiB ones (NumPy asks for huge pages for its large arrays: the read bandwidth the
benchmarks measure with it is the second kind). XLA:CPU allocates its buffers with malloc, in
4 KiB pages unless the system's THP setting is "always" (the common default is "madvise"), so
the runner asks Linux to back its weight buffers with huge pages once they are placed:
`advise` marks each buffer's range MADV_HUGEPAGE and collapses it into huge pages now
(MADV_COLLAPSE, Linux 6.1+; older kernels leave the collapsing to khugepaged, in the
background).

The range advised is each buffer widened to the 2 MiB boundaries around it, clipped to the
mapping it lies in: a buffer smaller than 2 MiB (most of a small model's) gets a huge page only
together with its neighbours in the heap, whose contents a collapse keeps as they are. Best
effort: anywhere this fails (no THP, another OS, an old kernel, no huge page free) the buffers
keep their pages and nothing else changes. `JAXPAGE_CPU_HUGE_PAGES=0` turns it off.

The KV pool (`advise_zeroed`) needs them as much: attention reads each sequence's blocks where
they lie, and in a pool in use those are scattered over it, a 4 KiB page apiece (a bfloat16 K
tile of SmolLM2 is 2 KiB), each a TLB miss. Collapsing the pool as the weights are would copy
it (~6 s a GiB on that machine); a fresh pool holds only zeros, so instead the whole
2 MiB pages inside each of its buffers are marked MADV_HUGEPAGE and given back
(MADV_DONTNEED): a private anonymous page given back reads as zeros, as the pool did, and the
first write into each 2 MiB faults in a huge page. Measured on the same machine, alternating in
one process (docs/bench/cpu_pool_huge_pages_2026-12-04.log): decode attention alone, 30 layers
over permuted tables, 1.14-1.36x (`scripts/lab/attention_pool_pages_ab.py`); a bfloat16
decode step over blocks spread across a 1 GiB pool 1.07x at 8 rows
(`scripts/lab/decode_step_ab.py --vs-4k-pool`).
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
MADV_DONTNEED = 4
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


def _mappings() -> tuple[list[int], list[int], list[bool]]:
    """The process's mappings (/proc/self/maps) as sorted start and end addresses, and whether
    each is private anonymous memory (malloc's: no file behind it), whose pages given back
    read as zeros."""
    starts, ends, anonymous = [], [], []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = fields[0].split("-")
            starts.append(int(start, 16))
            ends.append(int(end, 16))
            path = fields[5] if len(fields) > 5 else ""
            anonymous.append(fields[1].endswith("p") and fields[4] == "0"
                             and (not path or path == "[heap]" or path.startswith("[anon")))
    return starts, ends, anonymous


def _mapped(starts: list[int], ends: list[int], address: int, nbytes: int) -> range | None:
    """The indices of the mappings holding a buffer's bytes: one, or a run of adjacent ones (an
    earlier madvise splits a mapping where its range ends); None if /proc/self/maps does not
    show it all mapped."""
    i = bisect.bisect_right(starts, address) - 1
    j = bisect.bisect_right(starts, address + nbytes - 1) - 1
    if i < 0 or ends[j] < address + nbytes or any(ends[m] != starts[m + 1] for m in range(i, j)):
        return None
    return range(i, j + 1)


def anon_huge_bytes(address: int, nbytes: int) -> int:
    """AnonHugePages of the mappings overlapping [address, address + nbytes), in bytes
    (/proc/self/smaps): how much of a buffer's neighbourhood Linux backs with huge pages now
    (the mappings may hold more than the buffer)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start < address + nbytes and address < end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


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


def _prepared(arrays: Iterable[Any]) -> tuple | None:
    """(`host_buffers(arrays)`, madvise, `_mappings()`), or None where there is nothing to
    do: not `enabled()`, no CPU buffer, or no madvise or /proc/self/maps here."""
    if not enabled():
        return None
    buffers = host_buffers(arrays)
    if not buffers:
        return None
    try:
        return buffers, _madvise(), _mappings()
    except (OSError, AttributeError, ValueError, IndexError):
        return None


def advise(arrays: Iterable[Any]) -> int:
    """Back the CPU buffers of `arrays` with transparent huge pages (see the module docstring);
    returns the bytes of the 2 MiB-aligned ranges Linux collapsed into huge pages now (0 where
    it could not, or when not `enabled()`)."""
    if (prepared := _prepared(arrays)) is None:
        return 0
    buffers, madvise, (starts, ends, _) = prepared
    ranges = set()  # buffers in one huge page share its range
    for address, nbytes in buffers:
        if (held := _mapped(starts, ends, address, nbytes)) is None:
            continue  # not in mapped memory, as far as /proc/self/maps says: leave it
        lo = max(starts[held[0]], address // HUGE_PAGE * HUGE_PAGE)
        hi = min(ends[held[-1]], -(-(address + nbytes) // HUGE_PAGE) * HUGE_PAGE)
        ranges.add((lo, hi))
    collapsed = 0
    for lo, hi in sorted(ranges):
        madvise(lo, hi - lo, MADV_HUGEPAGE)
        # only whole huge pages collapse: the aligned part of the range, a page at a time (one
        # that cannot, e.g. for want of a free huge page, fails alone)
        first, last = inner_pages(lo, hi - lo)
        for page in range(first, last, HUGE_PAGE):
            if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE
    return collapsed


def inner_pages(address: int, nbytes: int) -> tuple[int, int]:
    """[first, last): the whole 2 MiB pages inside a buffer's bytes (first == last: none)."""
    first = -(-address // HUGE_PAGE) * HUGE_PAGE
    return first, max(first, (address + nbytes) // HUGE_PAGE * HUGE_PAGE)


def advise_zeroed(arrays: Iterable[Any]) -> int:
    """Back the CPU buffers of `arrays`, which must hold only zero bytes (a fresh KV pool),
    with transparent huge pages without copying them (see the module docstring): the whole
    2 MiB pages inside each buffer, where it lies in private anonymous memory, are marked
    MADV_HUGEPAGE and given back (MADV_DONTNEED; they read as zeros again, and each comes back
    as a huge page on its first write). Nothing outside a buffer's own bytes is touched: its
    partial pages at either end keep their 4 KiB pages. Waits for the arrays first (an array
    still being filled would be written after). Returns the bytes given back (0 where none, or
    when not `enabled()`)."""
    arrays = [a for a in arrays if isinstance(a, jax.Array)]
    if (prepared := _prepared(arrays)) is None:
        return 0
    buffers, madvise, (starts, ends, anonymous) = prepared
    jax.block_until_ready(arrays)
    given = 0
    for address, nbytes in buffers:
        first, last = inner_pages(address, nbytes)
        held = _mapped(starts, ends, address, nbytes)
        if first == last or held is None or not all(anonymous[m] for m in held):
            continue  # a file's or shared pages would not read as zeros once given back
        if (madvise(first, last - first, MADV_HUGEPAGE) == 0
                and madvise(first, last - first, MADV_DONTNEED) == 0):
            given += last - first
    return given
