"""Benchmark the host block allocator: the cost per block must stay flat as the pool grows.

    python scripts/bench_allocator.py            # 1M blocks allocated per pool, 100k lookups
    python scripts/bench_allocator.py --quick    # 10x fewer operations

For pools of 1k, 10k, 100k and 1M blocks (block_size 16, sequences of 64 blocks) it times:

* alloc+free:         allocate + free, prefix caching off (pure free-queue work);
* alloc+commit+free:  allocate + commit of 1,024 unique tokens (64 block hashes) + free, in a pool
                      first filled with cached blocks: a server's steady state, where the hash
                      map holds ~pool entries and every fresh block evicts the LRU one;
* lookup:             ``lookup`` of a 1,025-token prompt whose 64 blocks are all cached (one of
                      the last 8 sequences committed above);
* hit alloc+free:     ``allocate`` reusing such a 64-block hit (each hit block leaves the LRU in
                      O(1)) + ``free`` (the blocks go back to the LRU).

and prints ns per block, operations per second, and each pool's ns per block over the 1k pool's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

from jaxpage.engine.block_allocator import BlockAllocator

BLOCK_SIZE = 16
SEQ_BLOCKS = 64
SEQ_TOKENS = SEQ_BLOCKS * BLOCK_SIZE
LIVE_SEQS = 8  # sequences alive at once in the alloc/free loops
HOT_PROMPTS = 8  # distinct cached prompts the lookups cycle through
CHUNKS = 10  # each measurement is timed in chunks; the median chunk is reported


def median_seconds_per_op(op: Callable[[int], object], num_ops: int, chunks: int = CHUNKS) -> float:
    """Run ``op(0) .. op(num_ops - 1)`` in ``chunks`` timed chunks; the median chunk's time per op.

    The median shrugs off bursts of load from other processes on a shared machine.
    """
    assert num_ops % chunks == 0, (num_ops, chunks)
    gc.collect()
    per_chunk, times = num_ops // chunks, []
    for chunk in range(chunks):
        start = time.perf_counter()
        for i in range(chunk * per_chunk, (chunk + 1) * per_chunk):
            op(i)
        times.append((time.perf_counter() - start) / per_chunk)
    return statistics.median(times)


def filled_cache(pool: int) -> BlockAllocator:
    """An allocator whose pool is filled with cached 64-block prompts (freed again)."""
    alloc = BlockAllocator(pool, BLOCK_SIZE)
    for seq in range((pool - 1) // (SEQ_BLOCKS + 1)):
        prompt = [-1 - seq] * (SEQ_TOKENS + 1)
        assert alloc.allocate(seq, len(prompt))
        alloc.commit(seq, prompt)
        alloc.free(seq)
    return alloc


def bench_alloc_free(alloc: BlockAllocator, num_seqs: int, commit: bool) -> float:
    """Seconds per 64-block sequence allocated (and committed) and freed.

    Keeps ``LIVE_SEQS`` sequences alive. With ``commit``, each sequence's tokens are unique (64
    new hashes) and, in a pool full of cached blocks, every fresh block evicts one.
    """
    def op(seq: int) -> None:
        if not alloc.allocate(seq, SEQ_TOKENS):
            raise RuntimeError(f"pool of {alloc.num_blocks} blocks is too small")
        if commit:
            alloc.commit(seq, [seq] * SEQ_TOKENS)
        if seq >= LIVE_SEQS:
            alloc.free(seq - LIVE_SEQS)

    seconds = median_seconds_per_op(op, num_seqs)
    for seq in range(max(0, num_seqs - LIVE_SEQS), num_seqs):
        alloc.free(seq)
    assert alloc.usage()["used"] == 0
    return seconds


def bench_lookup(alloc: BlockAllocator, prompts: list[list[int]], num_lookups: int) -> float:
    """Seconds per lookup of a prompt whose 64 full blocks are all cached."""
    assert all(len(alloc.lookup(prompt).block_ids) == SEQ_BLOCKS for prompt in prompts)
    return median_seconds_per_op(lambda i: alloc.lookup(prompts[i % len(prompts)]), num_lookups)


def bench_hit_alloc_free(alloc: BlockAllocator, prompts: list[list[int]], num_ops: int) -> float:
    """Seconds per allocate (reusing a 64-block hit, one fresh block) + free."""
    hits = [alloc.lookup(prompt) for prompt in prompts]

    def op(i: int) -> None:
        assert alloc.allocate("s", SEQ_TOKENS + 1, hits[i % len(hits)])
        alloc.free("s")

    seconds = median_seconds_per_op(op, num_ops)
    alloc.check_invariants()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x fewer operations")
    parser.add_argument("--pools", type=int, nargs="+",
                        default=[1_000, 10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    num_seqs = 1_000_000 // SEQ_BLOCKS // scale // CHUNKS * CHUNKS  # ~1M blocks (100k quick)
    num_lookups = 100_000 // scale
    print(f"block_size={BLOCK_SIZE}, {SEQ_BLOCKS}-block sequences; per pool: "
          f"{num_seqs * SEQ_BLOCKS:,} blocks allocated+freed (twice), {num_lookups:,} lookups, "
          f"{num_lookups:,} hit allocations; median of {CHUNKS} chunks")
    names = ["alloc+free", "alloc+commit+free", "lookup (64 blk)", "hit alloc+free"]
    rows = []
    for pool in args.pools:
        start = time.perf_counter()
        no_caching = BlockAllocator(pool, BLOCK_SIZE, enable_prefix_caching=False)
        alloc_free = bench_alloc_free(no_caching, num_seqs, commit=False)
        alloc = filled_cache(pool)
        alloc_commit = bench_alloc_free(alloc, num_seqs, commit=True)
        # the last sequences committed are the most recently cached: the hot prompts
        prompts = [[seq] * (SEQ_TOKENS + 1) for seq in range(num_seqs - HOT_PROMPTS, num_seqs)]
        lookup = bench_lookup(alloc, prompts, num_lookups)
        hit = bench_hit_alloc_free(alloc, prompts, num_lookups)
        rows.append((pool, [alloc_free, alloc_commit, lookup, hit]))
        print(f"  pool {pool:>9,}: {time.perf_counter() - start:5.1f} s", flush=True)
    print(f"\n{'pool blocks':>11} | " + " | ".join(f"{n:>25}" for n in names))
    print(f"{'':>11} | " + " | ".join(f"{'ns/blk    ops/s  ratio':>25}" for _ in names))
    print("-" * (14 + 28 * len(names)))
    for pool, seconds_per_op in rows:
        cells = []
        for seconds, base in zip(seconds_per_op, rows[0][1], strict=True):
            per_block = seconds / SEQ_BLOCKS
            cells.append(f"{per_block * 1e9:6.0f} {1 / seconds:8,.0f} {seconds / base:5.2f}x")
        print(f"{pool:>11,} | " + " | ".join(f"{c:>25}" for c in cells))
    print("ops/s: sequences (or lookups) per second; ratio: ns/blk over the first pool's")


if __name__ == "__main__":
    main()
