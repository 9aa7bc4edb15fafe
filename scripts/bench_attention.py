"""CPU attention paths on SmolLM2-shaped steps: the C++ kernel, blockwise jnp and dense.

The C++ kernel (`cpp` backend), the blockwise `jnp` backend and the dense `reference`, in one
process.

Each case is one engine-like step (per layer a K/V pool of 2048 blocks x 16 tokens, 3 KV
heads, 9 query heads, head_dim 64, float32, permuted block tables) timed over 30 layers, as a
decode or prefill step of the 30-layer SmolLM2 runs it. Every layer reads its own pool, as in
the model: with one pool shared by all layers XLA would gather the dense path's K/V once and
reuse it 30 times. Cases: decode batches with uniform and long-tailed (log-normal) contexts,
and prefill steps mixing chunk lengths as the scheduler packs them. Prints milliseconds for
each path, the blockwise/cpp ratio, the K/V bytes the step must read and the rate the cpp
kernel reads them at, and the largest difference of each path from the dense one (they
compute the same function); then the cpp kernel on the same step over block tables in pool
order (a sequence's blocks adjacent) and the permuted step's time over that: what the blocks'
placement costs (a permuted table puts each next block pages away).
First it prints this machine's memory ceilings in the same process: a `jnp.sum` over all K
pools (read only) and an elementwise copy of them (read + write, the traffic of
materializing gathered K/V).

    python scripts/bench_attention.py
    python scripts/bench_attention.py --cpp-only --dtype bfloat16   # the kernel alone

To compare two builds of the kernel, run it twice with JAXPAGE_CPU_KERNEL_LIB naming each
(`cpu_library._build()` writes the current source's under ~/.cache/jaxpage). The kernel on
pools of 4 KiB pages against huge pages is scripts/lab/attention_pool_pages_ab.py.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import HEAD_DIM, HEADS, KV_HEADS, LAYERS, median_seconds

from pallas_kernels import cpu_ops
from pallas_kernels.blockwise import paged_attention_blockwise
from pallas_kernels.reference import paged_attention_reference

GROUP = HEADS // KV_HEADS  # query heads a KV head serves
BLOCK, POOL_BLOCKS = 16, 2048


def cases(rng):
    """(name, sequence lengths after the step, new tokens per sequence, max_query_len)."""
    def lognormal(n):
        return [int(x) for x in np.clip(rng.lognormal(np.log(150), 0.8, n), 10, 760)]

    chunks = [72, 56, 121, 71, 37, 91, 64]
    return [
        ("decode b64, context 257", [257] * 64, [1] * 64, 1),
        ("decode b64, log-normal context", lognormal(64), [1] * 64, 1),
        ("decode b32, log-normal context", lognormal(32), [1] * 32, 1),
        ("decode b8, mixed context", [700, 30, 50, 100, 200, 20, 10, 300], [1] * 8, 1),
        ("decode b8, context 129", [129] * 8, [1] * 8, 1),  # profile_layer_stages' step
        ("prefill 7 chunks ~70 tokens", chunks + [0], chunks + [0], 128),
        ("prefill 374 (after 80) + 92", [454, 92, 0, 0], [374, 92, 0, 0], 512),
        ("prefill 1 long + 40 short", [300] + [20] * 40 + [0] * 23,
         [200] + [20] * 15 + [2] * 25 + [0] * 23, 256),
    ]


def make_step(rng, lens, new, dtype=np.float32, ordered=False):
    """One step's (q, block tables, lengths, query_start_loc, K/V bytes read over all layers):
    each sequence's blocks taken from a permutation of the pool, or with `ordered` in pool
    order (a sequence's blocks adjacent, as the allocator hands out a prompt's)."""
    num_seqs = len(lens)
    width = max(4, 1 << (-(-max(lens) // BLOCK) - 1).bit_length())
    tables = np.zeros((num_seqs, width), np.int32)
    physical = np.arange(1, POOL_BLOCKS)
    if not ordered:
        physical = rng.permutation(physical)
    used = 0
    for s, length in enumerate(lens):
        n = -(-length // BLOCK)
        tables[s, :n] = physical[used : used + n]
        used += n
    query_start_loc = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    num_tokens = max(int(query_start_loc[-1]), num_seqs)
    num_tokens = 1 << (num_tokens - 1).bit_length()
    q = jnp.asarray(rng.standard_normal((num_tokens, KV_HEADS * GROUP, HEAD_DIM)), dtype)
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize * LAYERS
    return q, tables, np.asarray(lens, np.int32), query_start_loc, kv_bytes


def make_pools(dtype) -> tuple[list, list]:
    """Each layer's K and V pools (LAYERS of each, POOL_BLOCKS blocks), standard normal."""
    pool_rng = np.random.default_rng(1)
    shape = (KV_HEADS, POOL_BLOCKS, BLOCK, HEAD_DIM)
    return tuple([jnp.asarray(pool_rng.standard_normal(shape, np.float32), dtype)
                  for _ in range(LAYERS)] for _ in range(2))


def all_layers(attend, q, k_pools, v_pools, *step):
    """One step's attention in every layer (`attend(q, k_pool, v_pool, *step)`), each layer's
    queries a little apart, summed: one output for LAYERS calls."""
    return sum(attend(q + i * 1e-3, k_pools[i], v_pools[i], *step) for i in range(LAYERS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the pools' and queries' dtype")
    ap.add_argument("--cpp-only", action="store_true",
                    help="time the C++ kernel only (the max diff is then against float32's "
                         "dense path on the same inputs)")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    k_pools, v_pools = make_pools(dtype)
    pool_bytes = LAYERS * k_pools[0].nbytes
    read_s = median_seconds(jax.jit(lambda pools: sum(p.sum() for p in pools)), k_pools)
    copy_s = median_seconds(jax.jit(lambda pools: [p + 1.0 for p in pools]), k_pools)
    print(f"memory ceilings over {pool_bytes / 1e6:.0f} MB of K pools: jnp.sum reads "
          f"{pool_bytes / read_s / 1e9:.1f} GB/s; a copy moves "
          f"{pool_bytes / copy_s / 1e9:.1f} GB/s each way")
    paths = {} if args.cpp_only else {"dense": paged_attention_reference,
                                       "blockwise": paged_attention_blockwise}
    if cpu_ops.available():
        paths["cpp"] = lambda *args, max_query_len: cpu_ops.paged_attention_cpu(*args)
    elif args.cpp_only:
        raise SystemExit("the CPU kernel library is not available")
    print(f"{'case':<34}{'dense ms':>10}{'blockwise ms':>14}{'cpp ms':>8}{'blockw/cpp':>11}"
          f"{'KV MB':>7}{'cpp GB/s':>9}{'max diff':>10}{'cpp ordered':>12}{'perm/ord':>9}")
    for name, lens, new, max_query_len in cases(rng):
        q, tables, seq_lens, qsl, kv_bytes = make_step(rng, lens, new, dtype)
        seconds, outs = {}, {}
        for label, attend in paths.items():
            fn = jax.jit(functools.partial(
                all_layers, functools.partial(attend, max_query_len=max_query_len)))
            seconds[label] = median_seconds(fn, q, k_pools, v_pools, tables, seq_lens, qsl)
            outs[label] = fn(q, k_pools, v_pools, tables, seq_lens, qsl)
            if label == "cpp":  # the same step over tables in pool order: where blocks lie
                ordered = make_step(np.random.default_rng(0), lens, new, dtype, ordered=True)[1]
                seconds["cpp ordered"] = median_seconds(fn, q, k_pools, v_pools, ordered,
                                                        seq_lens, qsl)
        nan = float("nan")
        diff = nan if "dense" not in outs else max(
            float(jnp.abs(outs["dense"] - out).max()) / LAYERS for out in outs.values())
        cpp = seconds.get("cpp", nan)
        def column(value, width, spec):  # "-" for a path not run
            return f"{'-' if value != value else format(value, spec):>{width}}"

        print(f"{name:<34}{column(seconds.get('dense', nan) * 1e3, 10, '.1f')}"
              f"{column(seconds.get('blockwise', nan) * 1e3, 14, '.1f')}"
              f"{column(cpp * 1e3, 8, '.1f')}"
              f"{column(seconds.get('blockwise', nan) / cpp, 10, '.2f')}"
              f"{'x' if 'blockwise' in seconds else ' '}"
              f"{kv_bytes / 1e6:>7.0f}{column(kv_bytes / cpp / 1e9, 9, '.1f')}"
              f"{column(diff, 10, '.1e')}"
              f"{column(seconds.get('cpp ordered', nan) * 1e3, 12, '.1f')}"
              f"{column(cpp / seconds.get('cpp ordered', nan), 9, '.2f')}", flush=True)


if __name__ == "__main__":
    main()
