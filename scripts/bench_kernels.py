"""Check and time the Pallas attention kernels on a GPU or TPU, in one call.

    python scripts/bench_kernels.py --quick --out bench_kernels.json   # ~5-7 min on one H200
    python scripts/bench_kernels.py --quick --sections ragged,engine   # ~5 min (no decode grid)
    python scripts/bench_kernels.py --quick --sweep                    # + the ragged kernel's knobs
    python scripts/bench_kernels.py --interpret                        # CPU smoke (interpret)
    python scripts/bench_kernels.py --kernel-arg num_warps=8 ...       # pass knobs to ours

On the accelerator JAX finds (a CUDA GPU or a TPU; on CPU it exits unless --interpret) it runs
these sections (`--sections`, in order), bf16, 32 query / 8 KV heads of 128 (Llama-3-8B's
attention) unless said:

* ragged: decode, prefill and mixed steps (RAGGED_SCENARIOS, incl. two at SmolLM2's heads)
  through our ragged kernel (`ragged_paged_attention_gpu` / `_tpu`), against contiguous
  attention in plain jnp/XLA over [S, L, K, D] caches holding the same K/V (queries padded to
  the longest chunk), our decode kernel (decode steps), and JAX's shipped kernels: on GPU
  `ops.gpu.paged_attention` (decode) and `ops.gpu.attention.mha` (fresh prompts, contiguous),
  on TPU `ops.tpu.ragged_paged_attention` (every step). Then the in-place K/V write into a
  donated 4 GiB pool against one pass over it.
* engine: a random-weight model at SmolLM2-135M's shapes generating greedily with our
  kernels and with the jnp path (bf16: tok/s), and in float32 at full matmul precision
  against the dense reference backend (the tokens must agree).
* decode: the decode kernel's grid of (batch, context, block size), every sequence at full
  length, against contiguous attention and JAX's paged decode kernel
  (`ops.gpu.paged_attention` / `ops.tpu.paged_attention`, the same [K, N, B, D] pool).

Each method is first checked against `paged_attention_reference`, then timed on the device:
one jitted executable chains `iters x R` calls, each call's output being the next call's query
(a true dependency, so XLA can neither hoist nor overlap calls), for the decode grid over R
input sets (disjoint, randomly permuted blocks of one pool; R separate contiguous caches)
rotating so that the sets together exceed the L2 cache where memory allows; `iters` is sized
so one timed run lasts ~20-50 ms, and the median of several runs after a warm-up, divided by
the calls in it, is reported. It prints tables of times, ratios, GB/s and TFLOP/s against the
bytes and FLOPs that bound each step, and writes every timing to --out as JSON. `--budget-s`
stops starting decode configs and sweep settings past a time, to fit a lease.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import pathlib
import platform as host_platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import parse_name_values

from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.paged_decode_tpu import paged_decode_attention_tpu
from pallas_kernels.ragged_paged_gpu import ragged_paged_attention_gpu
from pallas_kernels.reference import paged_attention_reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = jnp.bfloat16
TOLERANCE = 2e-2
MAX_TOKENS = 1 << 20  # batch x context per set: 4 GiB of K+V at these head counts
L2_BYTES = 60 * 2**20  # H200's L2; the rotation aims at twice this
MAX_SETS = 16
CHECK_SEQS = 4  # sequences compared against the reference

GRIDS = {
    "full": dict(batches=(1, 4, 16, 64, 256), contexts=(128, 512, 2048, 8192, 32768),
                 block_sizes=(16, 32), target_s=0.05, repeats=11),
    "quick": dict(batches=(1, 8, 64, 256), contexts=(128, 2048, 32768),
                  block_sizes=(16, 32), target_s=0.02, repeats=7),
    # CPU interpret smoke: tiny heads, two sets, one timed run (times mean nothing there)
    "interpret": dict(batches=(1, 3), contexts=(64, 128), block_sizes=(16, 32),
                      target_s=0.0, repeats=1, heads=(4, 2, 128), max_sets=2),
}


# --- the methods: f(q, data, r) -> next q, for input set r ---------------------------------

def contiguous_attention(q, k_cache, v_cache, lengths):
    """Dense decode attention: q [S, H, D], caches [S, L, K, D], lengths [S] -> [S, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    _, max_len, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    # [S, K, G, D] x [S, L, K, D] -> [S, K, G, L]
    scores = jnp.einsum("skgd,slkd->skgl", q, k_cache, preferred_element_type=jnp.float32)
    scores = scores * head_dim**-0.5
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]  # [S, L]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    # [S, K, G, L] x [S, L, K, D] -> [S, K, G, D]
    out = jnp.einsum("skgl,slkd->skgd", probs, v_cache, preferred_element_type=jnp.float32)
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def load_jax_kernel(platform: str):
    """JAX's own paged attention for the platform, or the reason it is unavailable."""
    try:
        with warnings.catch_warnings():
            # jax 0.11 deprecates the GPU module itself (on import) and the Triton backend
            warnings.filterwarnings("ignore", category=DeprecationWarning,
                                    message=r".*(paged_attention is deprecated|Pallas Triton)")
            if platform == "gpu":
                from jax.experimental.pallas.ops.gpu import paged_attention as module
            else:
                from jax.experimental.pallas.ops.tpu import paged_attention as module
        return module.paged_attention, None
    except Exception as error:  # removed in a later jax, or fails to import
        return None, f"{type(error).__name__}: {error}"


def make_methods(platform: str, interpret: bool, kernel_args: dict, block_size: int,
                 pages_per_seq: int):
    """name -> f(q, data, r), and name -> why it is unavailable."""
    unavailable = {}

    def contiguous(q, data, r):
        return contiguous_attention(q, data["k_dense"][r], data["v_dense"][r], data["lengths"])

    if platform == "gpu":
        def paged(q, data, r):
            return paged_decode_attention_gpu(
                q, data["k_pool"], data["v_pool"], data["tables"][r], data["lengths"],
                interpret=interpret, **kernel_args)
    else:
        def paged(q, data, r):
            return paged_decode_attention_tpu(
                q, data["k_pool"], data["v_pool"], data["tables"][r], data["lengths"],
                interpret=interpret, **kernel_args)

    methods = {"paged": paged, "contiguous": contiguous}
    # JAX's kernels apply no softmax scale: the query is pre-scaled for them
    jax_kernel, reason = load_jax_kernel(platform)
    if jax_kernel is None:
        unavailable["jax"] = reason
    elif platform == "gpu":
        # its constraints: pages % k_splits == 0, (pages / k_splits) % pages_per_block == 0
        k_splits = largest_divisor(pages_per_seq, 16)
        per_block = largest_divisor(pages_per_seq // k_splits, 8)

        def jax_paged(q, data, r):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=DeprecationWarning,
                                        message=r".*Pallas Triton")
                q = (q * q.shape[-1] ** -0.5).astype(q.dtype)
                return jax_kernel(q, data["k_pool"], data["v_pool"], data["tables"][r],
                                  data["lengths"], k_splits=k_splits,
                                  pages_per_compute_block=per_block, interpret=interpret)
        methods["jax"] = jax_paged
    else:
        per_block = largest_divisor(pages_per_seq, max(1, 128 // block_size))

        def jax_paged(q, data, r):
            context = contextlib.nullcontext()
            if interpret:
                from jax.experimental.pallas import tpu as pltpu
                context = pltpu.force_tpu_interpret_mode()
            q = (q * q.shape[-1] ** -0.5).astype(q.dtype)
            with context:
                return jax_kernel(q, data["k_pool"], data["v_pool"], data["lengths"],
                                  data["tables"][r], pages_per_compute_block=per_block)
        methods["jax"] = jax_paged
    return methods, unavailable


# --- inputs ------------------------------------------------------------------------------

def make_data(key, *, batch, context, block_size, num_sets, heads):
    """One pool holding `num_sets` disjoint sets of pages (random block order), their block
    tables, the same K/V as contiguous [S, L, K, D] caches, and a first query."""
    num_heads, num_kv_heads, head_dim = heads
    pages = context // block_size
    num_blocks = 1 + num_sets * batch * pages
    k_key, v_key, q_key, perm_key = jax.random.split(key, 4)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pool = jax.random.normal(k_key, shape, DTYPE)
    v_pool = jax.random.normal(v_key, shape, DTYPE)
    block_ids = 1 + jax.random.permutation(perm_key, num_blocks - 1).astype(jnp.int32)
    tables = block_ids.reshape(num_sets, batch, pages)

    @jax.jit
    def contiguous_cache(pool, table):  # [K, N, B, D], [S, P] -> [S, P * B, K, D]
        gathered = pool[:, table]  # [K, S, P, B, D]
        return gathered.transpose(1, 2, 3, 0, 4).reshape(batch, context, num_kv_heads, head_dim)

    return dict(
        k_pool=k_pool, v_pool=v_pool, tables=[tables[r] for r in range(num_sets)],
        lengths=jnp.full((batch,), context, jnp.int32),
        k_dense=[contiguous_cache(k_pool, tables[r]) for r in range(num_sets)],
        v_dense=[contiguous_cache(v_pool, tables[r]) for r in range(num_sets)],
    ), jax.random.normal(q_key, (batch, num_heads, head_dim), DTYPE)


def reference_chain(q, data, num_sets, num_seqs):
    """The reference applied set after set (output -> next query) to the first sequences."""
    q = q[:num_seqs]
    starts = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    for r in range(num_sets):
        q = paged_attention_reference(q, data["k_pool"], data["v_pool"],
                                      data["tables"][r][:num_seqs], data["lengths"][:num_seqs],
                                      starts, max_query_len=1)
    return q


def make_runner(method, num_sets):
    """One executable: `iters` rounds of the R sets, each call's output the next query."""
    @jax.jit
    def run(q, data, iters):
        def one_round(_, q):
            for r in range(num_sets):
                q = method(q, data, r)
            return q
        return jax.lax.fori_loop(0, iters, one_round, q)
    return run


def time_method(run, q, data, num_sets, target_s, repeats):
    """Median seconds per call over `repeats` timed runs (the first call has compiled)."""
    start = time.perf_counter()
    run(q, data, 1).block_until_ready()
    one_round = time.perf_counter() - start
    iters = 1 if target_s <= 0 else int(min(10_000, max(1, math.ceil(target_s / one_round))))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(q, data, iters).block_until_ready()
        per_call.append((time.perf_counter() - start) / (iters * num_sets))
    return statistics.median(per_call), iters


# --- the benchmark -------------------------------------------------------------------------

def configs(grid):
    for block_size in grid["block_sizes"]:
        for batch in grid["batches"]:
            for context in grid["contexts"]:
                if batch * context <= MAX_TOKENS and context % block_size == 0:
                    yield batch, context, block_size


def bench_config(platform, interpret, kernel_args, grid, batch, context, block_size, seed):
    heads = grid.get("heads", (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM))
    num_heads, num_kv_heads, head_dim = heads
    set_bytes = 2 * batch * context * num_kv_heads * head_dim * jnp.dtype(DTYPE).itemsize
    num_sets = int(min(grid.get("max_sets", MAX_SETS), max(2, math.ceil(2 * L2_BYTES / set_bytes))))
    data, q = make_data(jax.random.key(seed), batch=batch, context=context,
                        block_size=block_size, num_sets=num_sets, heads=heads)
    check_seqs = min(batch, CHECK_SEQS)
    expected = np.asarray(reference_chain(q, data, num_sets, check_seqs).astype(jnp.float32))
    methods, unavailable = make_methods(platform, interpret, kernel_args, block_size,
                                        context // block_size)
    record = dict(batch=batch, context=context, block_size=block_size, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=jnp.dtype(DTYPE).name,
                  rotation_sets=num_sets, set_bytes=set_bytes,
                  l2_resident=num_sets * set_bytes < 2 * L2_BYTES,
                  seconds_per_call={}, iters={}, max_abs_error={}, matches_reference={},
                  errors=dict(unavailable))
    for name, method in methods.items():
        try:
            run = make_runner(method, num_sets)
            out = np.asarray(run(q, data, 1)[:check_seqs].astype(jnp.float32))  # compiles
            error = float(np.abs(out - expected).max())
            record["max_abs_error"][name] = error
            record["matches_reference"][name] = bool(
                np.allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE))
            seconds, iters = time_method(run, q, data, num_sets, grid["target_s"],
                                         grid["repeats"])
            record["seconds_per_call"][name] = seconds
            record["iters"][name] = iters
        except Exception as error:  # keep going: one method failing is a result too
            record["errors"][name] = f"{type(error).__name__}: {str(error)[:500]}"
    times = record["seconds_per_call"]
    if "paged" in times:
        record["paged_gb_per_s"] = set_bytes / times["paged"] / 1e9
        for other in ("contiguous", "jax"):
            if other in times:
                record[f"paged_over_{other}"] = times["paged"] / times[other]
    return record


# --- ragged batches: decode, prefill and mixed steps ----------------------------------------

# (name, [(tokens cached before the step, new tokens)] per sequence): the steps an engine runs
RAGGED_SCENARIOS = {
    "full": [
        ("decode 64x2k", [(2047, 1)] * 64),
        ("decode 256x512", [(511, 1)] * 256),
        ("decode 8x8k", [(8191, 1)] * 8),
        ("prefill 4x512 new", [(0, 512)] * 4),
        ("prefill 2x1k after 3k", [(3072, 1024)] * 2),
        ("mixed 64 dec@1k + 2x512", [(1023, 1)] * 64 + [(0, 512), (1536, 512)]),
        ("mixed 128 dec@2k + 256", [(2047, 1)] * 128 + [(4096, 256)]),
        # SmolLM2-135M's attention: 3 query heads per KV head, head_dim 64
        ("smollm2: decode 64x2k", [(2047, 1)] * 64, (9, 3, 64)),
        ("smollm2: mixed 32 dec + 2x256", [(1023, 1)] * 32 + [(0, 256), (700, 256)],
         (9, 3, 64)),
    ],
    "interpret": [
        ("decode 3x100", [(99, 1)] * 3),
        ("prefill 2x40", [(0, 40), (24, 40)]),
        ("mixed 2 dec + 33", [(50, 1), (7, 1), (16, 33)]),
    ],
}
RAGGED_GRID = {"full": "full", "quick": "full", "interpret": "interpret"}
# Kernel settings tried by --sweep (ragged kernel only): tile rows for chunks, keys per
# inner step (pages of 16), Triton warps and pipeline stages
SWEEP = {
    "gpu": [dict(query_rows=64, pages_per_compute_block=4, num_warps=4, num_stages=2),
            dict(query_rows=128, pages_per_compute_block=4, num_warps=8, num_stages=2),
            dict(query_rows=64, pages_per_compute_block=8, num_warps=4, num_stages=2),
            dict(query_rows=64, pages_per_compute_block=2, num_warps=4, num_stages=3),
            dict(query_rows=32, pages_per_compute_block=4, num_warps=4, num_stages=2),
            dict(query_rows=64, pages_per_compute_block=8, num_warps=8, num_stages=3),
            dict(pages_per_compute_block=16, num_warps=4, num_stages=2),
            dict(pages_per_compute_block=8, num_warps=8, num_stages=3)],
    "tpu": [dict(pages_per_compute_block=4), dict(pages_per_compute_block=8)],
}


def ragged_kernel(platform):
    if platform == "gpu":
        return ragged_paged_attention_gpu
    from pallas_kernels.ragged_paged_tpu import ragged_paged_attention_tpu

    return ragged_paged_attention_tpu


def make_ragged_data(key, seqs, block_size, heads, dtype=DTYPE):
    """A pool holding every sequence's K/V (random block order), the step's metadata, the
    same K/V as contiguous [S, L, K, D] caches, and the step's queries [T, H, D]."""
    num_heads, num_kv_heads, head_dim = heads
    lengths = [cached + new for cached, new in seqs]
    pages = [-(-n // block_size) for n in lengths]
    width = max(pages)
    num_blocks = 1 + sum(pages)
    k_key, v_key, q_key, perm_key = jax.random.split(key, 4)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pool = jax.random.normal(k_key, shape, dtype)
    v_pool = jax.random.normal(v_key, shape, dtype)
    block_ids = np.asarray(1 + jax.random.permutation(perm_key, num_blocks - 1))
    tables = np.zeros((len(seqs), width), np.int32)
    start = 0
    for s, n in enumerate(pages):
        tables[s, :n] = block_ids[start:start + n]
        start += n
    query_start = np.concatenate([[0], np.cumsum([new for _, new in seqs])]).astype(np.int32)
    num_tokens = int(query_start[-1])
    tables, lengths_arr = jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)

    @jax.jit
    def contiguous_cache(pool):  # [K, N, B, D] -> [S, W * B, K, D]
        gathered = pool[:, tables]  # [K, S, W, B, D]
        return gathered.transpose(1, 2, 3, 0, 4).reshape(
            len(seqs), width * block_size, num_kv_heads, head_dim)

    data = dict(k_pool=k_pool, v_pool=v_pool, tables=tables, lengths=lengths_arr,
                query_start=jnp.asarray(query_start), k_dense=contiguous_cache(k_pool),
                v_dense=contiguous_cache(v_pool))
    return data, jax.random.normal(q_key, (num_tokens, num_heads, head_dim), dtype)


def contiguous_ragged(q, data, max_query_len):
    """Dense causal attention over contiguous caches, queries padded to the longest chunk
    (what an engine without a ragged kernel runs): the reference's math on [S, L, K, D]."""
    k, v, lengths, starts = data["k_dense"], data["v_dense"], data["lengths"], data["query_start"]
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, max_len, num_kv_heads, _ = k.shape
    group, width = num_heads // num_kv_heads, max_query_len
    query_lens = starts[1:] - starts[:-1]
    offsets = jnp.arange(width)
    token = jnp.where(offsets[None] < query_lens[:, None], starts[:-1, None] + offsets, num_tokens)
    q_dense = q.at[token].get(mode="fill", fill_value=0).reshape(
        num_seqs, width, num_kv_heads, group, head_dim)
    query_pos = lengths[:, None] - query_lens[:, None] + offsets  # [S, Q]
    key_pos = jnp.arange(max_len)
    mask = (key_pos[None, None] <= query_pos[..., None]) & (key_pos < lengths[:, None])[:, None]
    scores = jnp.einsum("sqkgd,slkd->skgql", q_dense, k,
                        preferred_element_type=jnp.float32) * head_dim**-0.5
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0, probs).astype(v.dtype)
    out = jnp.einsum("skgql,slkd->sqkgd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(num_seqs * width, num_heads, head_dim).astype(q.dtype)
    return jnp.zeros_like(q).at[token.reshape(-1)].set(out, mode="drop")


def ragged_methods(platform, interpret, kernel_args, seqs, block_size, only_ragged=False):
    """name -> f(q, data) for one scenario, and name -> why one is unavailable."""
    kernel = ragged_kernel(platform)
    max_query_len = max(new for _, new in seqs)
    methods = {
        "ragged": lambda q, data: kernel(
            q, data["k_pool"], data["v_pool"], data["tables"], data["lengths"],
            data["query_start"], max_query_len=max_query_len, interpret=interpret,
            **kernel_args),
        "contiguous": functools.partial(contiguous_ragged, max_query_len=max_query_len),
    }
    unavailable = {}
    if only_ragged:
        return {"ragged": methods["ragged"]}, unavailable
    is_decode = all(new == 1 for _, new in seqs)
    fresh_prefill = all(cached == 0 for cached, _ in seqs) and len({n for _, n in seqs}) == 1
    if is_decode:
        decode = paged_decode_attention_gpu if platform == "gpu" else paged_decode_attention_tpu
        methods["decode_kernel"] = lambda q, data: decode(
            q, data["k_pool"], data["v_pool"], data["tables"], data["lengths"],
            interpret=interpret)
    if platform == "tpu":  # JAX's ragged kernel serves every step, decode included
        methods["jax"] = jax_tpu_ragged(interpret)
    elif is_decode:  # JAX's paged decode kernel as the decode grid runs it, on one set
        pages = max(-(-(c + n) // block_size) for c, n in seqs)
        decode_methods, missing = make_methods(platform, interpret, {}, block_size, pages)
        unavailable.update(missing)
        if "jax" in decode_methods:
            jax_one_set = decode_methods["jax"]
            methods["jax"] = lambda q, data: jax_one_set(q, dict(data, tables=[data["tables"]]),
                                                         0)
    elif fresh_prefill and not interpret:
        methods["jax"] = jax_flash_prefill(len(seqs), seqs[0][1])
    return methods, unavailable


def jax_tpu_ragged(interpret):
    """JAX's ragged paged attention for TPU (`ops.tpu.ragged_paged_attention`) on the same
    K/V, interleaved into its [pages, page_size, 2 * K, D] layout before timing."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as module

    def run(q, data):
        context = contextlib.nullcontext()
        if interpret:
            from jax.experimental.pallas import tpu as pltpu
            context = pltpu.force_tpu_interpret_mode()
        num_seqs = data["lengths"].shape[0]
        with context:
            return module.ragged_paged_attention(
                q, data["kv_pages"], data["lengths"], data["tables"], data["query_start"],
                jnp.array([num_seqs], jnp.int32), sm_scale=q.shape[-1] ** -0.5)
    return run


def interleave_kv(k_pool, v_pool):
    """Our [K, N, B, D] K and V pools -> JAX's TPU layout [N, B, 2K, D], K heads even."""
    num_kv_heads, num_blocks, block_size, head_dim = k_pool.shape
    both = jnp.stack([k_pool, v_pool], axis=-2)  # [K, N, B, 2, D]
    return both.transpose(1, 2, 0, 3, 4).reshape(num_blocks, block_size, 2 * num_kv_heads,
                                                 head_dim)


def jax_flash_prefill(num_seqs, chunk):
    """JAX's Pallas flash attention (ops.gpu.attention.mha, causal) over the contiguous
    prompts, K/V heads repeated to the query heads outside the timed call's math."""
    from jax.experimental.pallas.ops.gpu import attention

    def run(q, data):
        num_heads, head_dim = q.shape[1:]
        group = num_heads // data["k_dense"].shape[2]
        k = jnp.repeat(data["k_dense"][:, :chunk], group, axis=2)
        v = jnp.repeat(data["v_dense"][:, :chunk], group, axis=2)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            out = attention.mha(q.reshape(num_seqs, chunk, num_heads, head_dim), k, v, None,
                                sm_scale=head_dim**-0.5, causal=True)
        return out.reshape(q.shape)
    return run


def ragged_costs(seqs, heads, itemsize):
    """(bytes of K/V a step must read at least once, FLOPs of its causal products)."""
    num_heads, num_kv_heads, head_dim = heads
    kv_bytes = sum(c + n for c, n in seqs) * 2 * num_kv_heads * head_dim * itemsize
    # query i of a chunk sees cached + i + 1 keys; two products of 2 * D FLOPs per (q, key, head)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
    return kv_bytes, 4 * pairs * num_heads * head_dim


def bench_ragged(platform, interpret, kernel_args, scenario, seqs, block_size, heads, seed,
                 target_s, repeats, only_ragged=False):
    data, q = make_ragged_data(jax.random.key(seed), seqs, block_size, heads)
    if platform == "tpu":
        data["kv_pages"] = interleave_kv(data["k_pool"], data["v_pool"])
    expected = np.asarray(paged_attention_reference(
        q, data["k_pool"], data["v_pool"], data["tables"], data["lengths"],
        data["query_start"], max_query_len=max(new for _, new in seqs)).astype(jnp.float32))
    methods, unavailable = ragged_methods(platform, interpret, kernel_args, seqs, block_size,
                                          only_ragged)
    kv_bytes, flops = ragged_costs(seqs, heads, jnp.dtype(DTYPE).itemsize)
    record = dict(scenario=scenario, block_size=block_size, num_seqs=len(seqs),
                  num_tokens=int(q.shape[0]), heads=heads, kv_bytes=kv_bytes, flops=flops,
                  seconds_per_call={}, max_abs_error={}, matches_reference={},
                  errors=dict(unavailable))
    for name, method in methods.items():
        try:
            @jax.jit
            def run(q, data, iters, method=method):
                return jax.lax.fori_loop(0, iters, lambda _, q: method(q, data), q)
            out = np.asarray(run(q, data, 1).astype(jnp.float32))
            record["max_abs_error"][name] = float(np.abs(out - expected).max())
            record["matches_reference"][name] = bool(
                np.allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE))
            seconds, _ = time_method(run, q, data, 1, target_s, repeats)
            record["seconds_per_call"][name] = seconds
        except Exception as error:  # one method failing is a result too
            record["errors"][name] = f"{type(error).__name__}: {str(error)[:500]}"
    times = record["seconds_per_call"]
    if "ragged" in times:
        record["ragged_gb_per_s"] = kv_bytes / times["ragged"] / 1e9
        record["ragged_tflops"] = flops / times["ragged"] / 1e12
        for other in ("contiguous", "decode_kernel", "jax"):
            if other in times:
                record[f"ragged_over_{other}"] = times["ragged"] / times[other]
    return record


def bench_kv_write(interpret, block_size, heads, num_tokens, seed):
    """Seconds per donated in-place K/V write of `num_tokens` tokens into a 4 GiB pool (one
    layer's scatter as the engine runs it), against copying that pool once: tells whether
    the scatter is in place."""
    from pallas_kernels.blockwise import write_kv

    _, num_kv_heads, head_dim = heads
    pool_tokens = 8192 if interpret else 1 << 20
    shape = (num_kv_heads, pool_tokens // block_size, block_size, head_dim)
    k_pool = jnp.zeros(shape, DTYPE)
    v_pool = jnp.zeros(shape, DTYPE)
    key = jax.random.key(seed)
    new = jax.random.normal(key, (num_tokens, num_kv_heads, head_dim), DTYPE)
    slots = jax.random.permutation(key, pool_tokens)[:num_tokens].astype(jnp.int32)
    write = jax.jit(write_kv, donate_argnums=(0, 1))
    copy = jax.jit(lambda k, v: (k + 1, v + 1), donate_argnums=(0, 1))
    times = {}
    for name, fn, args in (("write", write, (new, new, slots)), ("copy", copy, ())):
        k_pool, v_pool = fn(k_pool, v_pool, *args)
        jax.block_until_ready(k_pool)
        calls = 3 if interpret else 50
        start = time.perf_counter()
        for _ in range(calls):
            k_pool, v_pool = fn(k_pool, v_pool, *args)
        jax.block_until_ready(k_pool)
        times[name] = (time.perf_counter() - start) / calls
    return dict(num_tokens=num_tokens, pool_bytes=2 * math.prod(shape) * jnp.dtype(DTYPE).itemsize,
                seconds=times)


def table_cells(record, ours: str, ratio_width: int):
    """(us(name), ratio(name)) formatters for one record's row: microseconds per call of a
    method, and `ours`' time over another method's."""
    times = record["seconds_per_call"]

    def us(name):
        return f"{times[name] * 1e6:10.1f}" if name in times else f"{'-':>10}"

    def ratio(name):
        value = record.get(f"{ours}_over_{name}")
        return f"{value:{ratio_width}.2f}" if value is not None else "-".rjust(ratio_width)

    return us, ratio


def print_ragged_row(record):
    us, ratio = table_cells(record, "ragged", 7)

    def check(name):
        if name in record["errors"]:
            return "E"
        if name not in record["matches_reference"]:
            return "-"
        return "." if record["matches_reference"][name] else "X"

    checks = "".join(map(check, ("ragged", "contiguous", "decode_kernel", "jax")))
    print(f"{record['scenario']:<26} {record['num_tokens']:>5} {us('ragged')} {us('contiguous')}"
          f" {us('decode_kernel')} {us('jax')} {ratio('contiguous')} {ratio('decode_kernel')}"
          f" {ratio('jax')} {record.get('ragged_gb_per_s', float('nan')):7.0f}"
          f" {record.get('ragged_tflops', float('nan')):7.1f} {checks:>5}", flush=True)


def run_ragged_section(platform, interpret, kernel_args, grid_name, grid, seed, records,
                       sweep=False):
    heads = grid.get("heads", (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM))
    print(f"\n[{platform} ragged{' ' + str(kernel_args) if sweep else ''}] heads {heads}, "
          "block 16; us per call; ratios ragged/other; "
          "GB/s and TFLOP/s of the ragged kernel against the K/V bytes and causal FLOPs; "
          "checks ragged,contig,decode,jax")
    print(f"{'scenario':<26} {'T':>5} {'ragged':>10} {'contig':>10} {'decode_k':>10} "
          f"{'jax':>10} {'r/cont':>7} {'r/dec':>7} {'r/jax':>7} {'GB/s':>7} {'TFLOP/s':>7} "
          f"{'chk':>5}")
    for i, (scenario, seqs, *scenario_heads) in enumerate(
            RAGGED_SCENARIOS[RAGGED_GRID[grid_name]]):
        if scenario_heads and grid_name == "interpret":
            continue  # the interpret grid keeps its tiny heads
        record = bench_ragged(platform, interpret, kernel_args, scenario, seqs, 16,
                              scenario_heads[0] if scenario_heads else heads,
                              seed + 1000 + i, grid["target_s"], grid["repeats"], sweep)
        record["platform"] = platform
        record["kernel_args"] = kernel_args
        records.append(record)
        print_ragged_row(record)
        for name, error in record["errors"].items():
            print(f"      {name}: {error}")
    for num_tokens in () if sweep else (1, 256, 4096):
        write = bench_kv_write(interpret, 16, heads, num_tokens, seed)
        records.append(dict(platform=platform, kv_write=write))
        print(f"K/V write of {num_tokens:>5} tokens into a donated "
              f"{write['pool_bytes'] / 2**30:.2f} GiB pool: "
              f"{write['seconds']['write'] * 1e6:9.1f} us; adding 1 to the pool (a full "
              f"read + write): {write['seconds']['copy'] * 1e6:9.1f} us")


# --- the engine: a whole model's steps through the ragged kernel --------------------------

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64)
ENGINE_WORKLOADS = {"full": dict(num_prompts=64, prompt_len=256, max_tokens=64),
                    "check": dict(num_prompts=32, prompt_len=128, max_tokens=32),
                    "interpret": dict(num_prompts=3, prompt_len=20, max_tokens=4)}


def random_model(seed, **shapes):
    """(model, params): a random-weight Llama of the given shapes, weights drawn on device."""
    from jaxpage.models.config import ModelConfig
    from jaxpage.models.llama import LlamaModel, param_shapes

    config = ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=8192,
                         tie_word_embeddings=True, **shapes)
    shapes_tree = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes_tree, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    params = [0.05 * jax.random.normal(k, shape, jnp.bfloat16)
              for k, shape in zip(keys, leaves, strict=True)]
    return LlamaModel(config), jax.tree.unflatten(treedef, params)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two generations differ (None if they agree)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def bench_engine(backends, interpret, workload_name, seed, dtype):
    """Greedy generation of one workload with each backend: tokens per second (after a
    warm-up run of the same workload compiled every shape) and the tokens."""
    from jaxpage import LLM, SamplingParams

    workload = ENGINE_WORKLOADS[workload_name]
    model, params = random_model(seed, **SMOLLM2_SHAPES)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, SMOLLM2_SHAPES["vocab_size"], workload["prompt_len"]).tolist()
               for _ in range(workload["num_prompts"])]
    sampling = SamplingParams(max_tokens=workload["max_tokens"], temperature=0, ignore_eos=True)
    results = {}
    for backend in backends:
        try:
            llm = LLM(model, params=params, dtype=dtype, attention_backend=backend,
                      kernel_interpret=interpret and backend.startswith("pallas"),
                      block_size=16, max_model_len=1024, max_num_seqs=64,
                      max_num_batched_tokens=2048, kv_cache_memory=2 << 30)
            llm.generate(prompts, sampling, use_tqdm=False)  # compiles
            start = time.perf_counter()
            outs = llm.generate(prompts, sampling, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = [o.outputs[0].token_ids for o in outs]
            results[backend] = dict(seconds=seconds, tokens=tokens,
                                    generated_per_s=sum(map(len, tokens)) / seconds,
                                    compiles=llm.engine.runner.compiles)
        except Exception as error:
            results[backend] = dict(error=f"{type(error).__name__}: {str(error)[:500]}")
    return workload, results


def run_engine_section(platform, interpret, grid_name, seed, records):
    """bfloat16 against the jnp path (speed), and float32 with every matmul at full precision
    against the dense reference (where greedy tokens must agree but for near-ties)."""
    ours = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}[platform]
    for dtype, other, precision, workload_name in (("bfloat16", "jnp", "default", "full"),
                                                   ("float32", "reference", "highest", "check")):
        if grid_name == "interpret":
            workload_name = "interpret"
        with jax.default_matmul_precision(precision):
            workload, results = bench_engine((ours, other), interpret, workload_name, seed,
                                             dtype)
        print(f"\n[{platform} engine] random-weight SmolLM2-135M shapes, {dtype}, matmul "
              f"precision {precision}, {workload}: greedy generation after a warm-up run")
        base = results.get(other, {}).get("tokens")
        for backend, result in results.items():
            if "error" in result:
                print(f"{backend:<12} error: {result['error']}")
                continue
            pairs = zip(result["tokens"], base, strict=True) if base else ()
            differ = [first_difference(a, b) for a, b in pairs]
            differ = [d for d in differ if d is not None]
            result["first_differences"] = differ
            print(f"{backend:<12} {result['seconds']:7.2f} s  {result['generated_per_s']:9.0f} "
                  f"generated tok/s  {result['compiles']:3d} compiles  identical to {other}: "
                  f"{len(result['tokens']) - len(differ) if base else '-'}/"
                  f"{len(result['tokens'])}; first differing token of the others: "
                  f"{sorted(differ)}")
        records.append(dict(platform=platform, engine=workload, dtype=dtype,
                            precision=precision, results={
                                b: {k: v for k, v in r.items() if k != "tokens"}
                                for b, r in results.items()}))


def print_row(record):
    us, ratio = table_cells(record, "paged", 8)

    checks = "".join(
        ("." if record["matches_reference"].get(n) else "X") if n not in record["errors"]
        else "E" for n in ("paged", "contiguous", "jax"))
    bandwidth = record.get("paged_gb_per_s")
    print(f"{record['batch']:>5} {record['context']:>6} {record['block_size']:>3} "
          f"{record['rotation_sets']:>3} {us('paged')} {us('contiguous')} {us('jax')} "
          f"{ratio('contiguous')} {ratio('jax')} "
          f"{bandwidth if bandwidth is not None else float('nan'):8.1f} {checks:>6}",
          flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the ~3-5 minute grid")
    parser.add_argument("--interpret", action="store_true",
                        help="tiny smoke run on CPU in Pallas interpret mode")
    parser.add_argument("--out", type=pathlib.Path, help="write all timings here as JSON")
    parser.add_argument("--kernel-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="keyword for our kernel, e.g. num_splits=8 (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default="ragged,engine,decode",
                        help="comma-separated, in order: ragged (decode, prefill and mixed "
                        "steps through the ragged kernel), engine (a random-weight model's "
                        "generation with our kernel and with jnp), decode (the decode "
                        "kernel's grid)")
    parser.add_argument("--sweep", action="store_true",
                        help="after the sections, time the ragged kernel alone at each of "
                        "SWEEP's settings (within --budget-s)")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="start no decode config after this many seconds (a lease's limit)")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    if args.interpret:
        platforms, grid_name = ("gpu", "tpu"), "interpret"
    elif backend in ("gpu", "cuda", "rocm"):
        platforms, grid_name = ("gpu",), "quick" if args.quick else "full"
    elif backend == "tpu":
        platforms, grid_name = ("tpu",), "quick" if args.quick else "full"
    else:
        sys.exit(f"bench_kernels: no accelerator (jax backend is {backend!r}); the kernels only "
                 "run on a CUDA GPU or a TPU. Use --interpret for a CPU smoke run.")
    grid = GRIDS[grid_name]
    kernel_args = parse_name_values(args.kernel_arg)
    device = jax.devices()[0]
    meta = dict(command=" ".join(sys.argv), jax=jax.__version__, backend=backend,
                device_kind=device.device_kind, host=host_platform.node(), grid=grid_name,
                kernel_args=kernel_args, tolerance=TOLERANCE)
    print(f"jax {jax.__version__} on {backend} ({device.device_kind}); grid {grid_name}; "
          f"kernel args {kernel_args or 'default'}")
    records = []
    started = time.perf_counter()
    sections = args.sections.split(",")
    skipped = 0
    for platform in platforms:
        for section in sections:
            if section == "ragged":
                run_ragged_section(platform, args.interpret, kernel_args, grid_name, grid,
                                   args.seed, records)
                continue
            if section == "engine":
                run_engine_section(platform, args.interpret, grid_name, args.seed, records)
                continue
            print(f"\n[{platform}] times in us per call; ratios paged/contiguous, paged/jax; "
                  "checks paged,contiguous,jax: . ok, X mismatch, E error")
            print(f"{'batch':>5} {'ctx':>6} {'blk':>3} {'R':>3} {'paged':>10} {'contig':>10} "
                  f"{'jax':>10} {'p/contig':>8} {'p/jax':>8} {'GB/s':>8} {'checks':>6}")
            for i, (batch, context, block_size) in enumerate(configs(grid)):
                if time.perf_counter() - started > args.budget_s:
                    skipped += 1
                    continue
                record = bench_config(platform, args.interpret, kernel_args, grid, batch,
                                      context, block_size, args.seed + i)
                record["platform"] = platform
                records.append(record)
                print_row(record)
                for name, error in record["errors"].items():
                    print(f"      {name}: {error}")
        for setting in SWEEP[platform] if args.sweep else ():
            if time.perf_counter() - started > args.budget_s:
                skipped += 1
                continue
            run_ragged_section(platform, args.interpret, setting, grid_name, grid, args.seed,
                               records, sweep=True)
    if skipped:
        print(f"skipped {skipped} decode configs or sweep settings past --budget-s "
              f"{args.budget_s:.0f}")
    meta["seconds"] = time.perf_counter() - started
    print(f"\n{len(records)} configs in {meta['seconds']:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
        print(f"wrote {args.out}")
    failed = [r for r in records if "errors" in r and (
        not all(r["matches_reference"].values()) or "paged" in r["errors"]
        or "ragged" in r["errors"])]
    if failed:
        print(f"{len(failed)} configs where a method disagrees with the reference or ours failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
