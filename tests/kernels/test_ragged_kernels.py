"""The ragged paged-attention kernels against a float64 NumPy oracle and the jnp reference.

On CPU both kernels run in Pallas interpret mode, the TPU one under the TPU interpreter
(simulated DMAs and semaphores, NaN in uninitialized VMEM, out-of-bounds reads raising).
Every mixed batch holds decode tokens, a chunk that starts mid-block and ends on a block
boundary, a one-token chunk that is a whole prompt, a long chunk over many blocks and
several tiles, a whole prompt from position 0, padding sequences (length 0, no queries)
between real ones and padding tokens at the end, over permuted block tables with NaN in
every pool slot no sequence owns. The fast set runs every value of each of (query heads per
KV head, head dims, block size, dtype); the `slow` set is the full product. The lowering tests
export the TPU kernel for TPU at production shapes.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_decode_kernels import (
    check_cuda_quantized_lowering,
    check_tpu_quantized_lowering,
)
from test_quantized_kv import assert_exact_and_near_oracle, one_format_each, quantized_batch

from pallas_kernels import quantized, ragged_paged_gpu
from pallas_kernels.ragged_paged_gpu import pool_head_dim as gpu_pool_head_dim
from pallas_kernels.ragged_paged_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_tpu import MAX_UNROLLED_HEADS, ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_tpu import pool_head_dim as tpu_pool_head_dim
from pallas_kernels.reference import paged_attention_reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings(
        f"ignore:{ragged_paged_gpu.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning"),
]

KERNELS = {
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
}
TOLERANCE = {np.float32: 1e-5, jnp.bfloat16: 2e-2}  # times the largest |expected|
DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16}
NUM_KV_HEADS = 2

GROUPS = (1, 3, 4, 8)  # query heads per KV head
# (q head_dim, pool head_dim): the pool may be wider, zero lanes past q's (TPU pools are
# allocated padded to 128 lanes)
HEAD_DIMS = {"64": (64, 64), "128": (128, 128), "64in128": (64, 128)}
BLOCK_SIZES = (16, 32)
# (group, head dims, block_size, dtype): the default suite runs every value of every factor
# at least once (checked by test_each_level_runs_by_default), in 4 rows; the slow suite the
# full product of 48 (a pairwise covering set of 12 rows ran by default until the suite
# passed 23 minutes on a 2-core Zen 3).
EACH_LEVEL = [(1, "64", 16, "f32"), (3, "64in128", 32, "bf16"), (4, "128", 16, "bf16"),
              (8, "64in128", 32, "f32")]
FULL_PRODUCT = list(itertools.product(GROUPS, HEAD_DIMS, BLOCK_SIZES, DTYPES))


def mixed_batch_spec(block_size: int) -> list[tuple[int, int]]:
    """(seq_len, query_len) of each sequence of a mixed step; contexts stay under 300 tokens
    to keep the interpreter quick."""
    b = block_size
    return [
        (5 * b + 3, 1),  # decode token, mid-block
        (0, 0),  # padding sequence
        (4 * b, 2 * b + 5),  # chunk starting mid-block, ending exactly on a block boundary
        (1, 1),  # a one-token prompt: a chunk of one token, not decode
        (0, 0),
        (270, 150),  # a long chunk over many blocks and several tiles
        (2 * b, 2 * b),  # a whole prompt from position 0, block-aligned
        (b - 1, 1),  # decode token in the first block
        (0, 0),  # trailing padding sequence
    ]


def decode_batch_spec(block_size: int) -> list[tuple[int, int]]:
    """A pure-decode step: one query per live sequence, edge lengths, padding rows."""
    b = block_size
    return [(b + 1, 1), (0, 0), (1, 1), (b, 1), (277, 1), (b - 1, 1), (0, 0)]


def make_batch(spec, *, group, head_dims, block_size, dtype, seed=0, padding_tokens=3,
               num_kv_heads=NUM_KV_HEADS, extra_blocks=3):
    """Random ragged inputs over a pool whose unowned slots are all NaN.

    Returns (q [T, H, D], k_pool and v_pool [K, N, B, Dp], block_tables [S, W] (a random
    permutation of the blocks; padding entries point at block 0, which is never owned),
    seq_lens [S], query_start_loc [S + 1]) and max_query_len. Owned slots hold zeros in
    lanes D..Dp, as the engine's padded pools do.
    """
    rng = np.random.default_rng(seed)
    head_dim, pool_dim = head_dims
    seq_lens = np.array([length for length, _ in spec], np.int32)
    query_lens = np.array([n for _, n in spec], np.int32)
    num_pages = -(-seq_lens // block_size)
    width = int(num_pages.max()) + 1  # one padding column at least
    num_blocks = 1 + int(num_pages.sum()) + extra_blocks
    pool_shape = (num_kv_heads, num_blocks, block_size, pool_dim)
    k_pool = np.full(pool_shape, np.nan, np.float32)
    v_pool = np.full(pool_shape, np.nan, np.float32)
    block_ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(spec), width), np.int32)
    used = 0
    for seq, (length, pages) in enumerate(zip(seq_lens, num_pages, strict=True)):
        tables[seq, :pages] = block_ids[used:used + pages]
        used += pages
        for page in range(pages):
            count = min(block_size, length - page * block_size)
            block = tables[seq, page]
            for pool in (k_pool, v_pool):
                pool[:, block, :count, :head_dim] = rng.standard_normal(
                    (num_kv_heads, count, head_dim))
                pool[:, block, :count, head_dim:] = 0
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1]) + padding_tokens
    # x2 so that softmaxes are peaked rather than near uniform
    q = 2 * rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
    cast = functools.partial(jnp.asarray, dtype=dtype)
    inputs = (cast(q), cast(k_pool), cast(v_pool), jnp.asarray(tables), jnp.asarray(seq_lens),
              jnp.asarray(query_start_loc))
    return inputs, int(query_lens.max())


def dense_oracle(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, scale=None):
    """Causal paged attention in float64 NumPy, one sequence and head at a time."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    k_pool = np.asarray(jnp.asarray(k_pool, jnp.float32), np.float64)
    v_pool = np.asarray(jnp.asarray(v_pool, jnp.float32), np.float64)
    tables, lens = np.asarray(block_tables), np.asarray(seq_lens)
    starts = np.asarray(query_start_loc)
    _, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros(q.shape, np.float64)  # padding tokens stay zero
    for seq, length in enumerate(lens):
        first, end = starts[seq], starts[seq + 1]
        if end == first:
            continue
        pages = tables[seq, :-(-length // block_size)]
        keys = k_pool[:, pages].reshape(num_kv_heads, -1, k_pool.shape[3])[:, :length, :head_dim]
        values = v_pool[:, pages].reshape(num_kv_heads, -1, v_pool.shape[3])[:, :length, :head_dim]
        positions = length - (end - first) + np.arange(end - first)  # the last tokens
        visible = np.arange(length)[None, :] <= positions[:, None]  # [n, L]
        for head in range(num_heads):
            scores = q[first:end, head] @ keys[head // group].T * scale
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[first:end, head] = (weights / weights.sum(axis=1, keepdims=True)
                                    ) @ values[head // group]
    return out


def jnp_reference(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *,
                  max_query_len, scale=None, **options):
    """`paged_attention_reference`, which wants the pool's head dim to be q's: lanes past
    q's are zero, so cutting them off changes nothing."""
    head_dim = q.shape[2]
    return paged_attention_reference(q, k_pool[..., :head_dim], v_pool[..., :head_dim],
                                     block_tables, seq_lens, query_start_loc,
                                     max_query_len=max_query_len, scale=scale, **options)


def assert_matches(out, inputs, max_query_len, dtype, scale=None):
    """Within tolerance of both oracles, finite, and zero on padding tokens."""
    q = inputs[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all()
    expected = dense_oracle(*inputs, scale=scale)
    reference = np.asarray(jnp_reference(*inputs, max_query_len=max_query_len, scale=scale)
                           .astype(jnp.float32), np.float64)
    atol = TOLERANCE[dtype] * np.abs(expected).max()
    np.testing.assert_allclose(out, expected, rtol=0, atol=atol)
    np.testing.assert_allclose(out, reference, rtol=0, atol=atol)
    last_token = int(np.asarray(inputs[5])[-1])
    assert (out[last_token:] == 0).all()


def run_case(kernel, spec_fn, group, head_dims, block_size, dtype_name, seed):
    dtype = DTYPES[dtype_name]
    inputs, max_query_len = make_batch(
        spec_fn(block_size), group=group, head_dims=HEAD_DIMS[head_dims],
        block_size=block_size, dtype=dtype, seed=seed)
    out = KERNELS[kernel](*inputs, max_query_len=max_query_len)
    assert_matches(out, inputs, max_query_len, dtype)


def test_each_level_runs_by_default():
    factors = (GROUPS, tuple(HEAD_DIMS), BLOCK_SIZES, tuple(DTYPES))
    for i, levels in enumerate(factors):
        assert set(levels) == {row[i] for row in EACH_LEVEL}


def test_oracle_is_the_reference_on_a_mixed_batch():
    """The float64 oracle is independent of the jnp reference: hold them to each other
    first, so that a kernel failure points at the kernel."""
    inputs, max_query_len = make_batch(mixed_batch_spec(16), group=3, head_dims=(64, 64),
                                       block_size=16, dtype=np.float32, seed=1)
    reference = np.asarray(jnp_reference(*inputs, max_query_len=max_query_len))
    np.testing.assert_allclose(reference, dense_oracle(*inputs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("group,head_dims,block_size,dtype_name", EACH_LEVEL)
def test_mixed_batch(kernel, group, head_dims, block_size, dtype_name):
    run_case(kernel, mixed_batch_spec, group, head_dims, block_size, dtype_name,
             seed=group * 1000 + block_size)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("group,head_dims,block_size,dtype_name", FULL_PRODUCT)
def test_mixed_batch_full_product(kernel, group, head_dims, block_size, dtype_name):
    run_case(kernel, mixed_batch_spec, group, head_dims, block_size, dtype_name,
             seed=7 + group + block_size)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("group,head_dims,block_size,dtype_name", [
    (4, "128", 16, "bf16"), (3, "64in128", 32, "f32"),
])
def test_pure_decode_batch(kernel, group, head_dims, block_size, dtype_name):
    """max_query_len 1: one-token tiles."""
    run_case(kernel, decode_batch_spec, group, head_dims, block_size, dtype_name, seed=group)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_custom_scale_and_odd_head_dims(kernel):
    """An explicit softmax scale, a head_dim of 80 (the pool padded inside the wrapper) and
    a pool wider than q but not lane-aligned (96 lanes for 64)."""
    for head_dims in ((80, 80), (64, 96)):
        inputs, max_query_len = make_batch([(40, 9), (0, 0), (17, 1)], group=2,
                                           head_dims=head_dims, block_size=16,
                                           dtype=np.float32, seed=5)
        out = KERNELS[kernel](*inputs, max_query_len=max_query_len, scale=0.3)
        assert_matches(out, inputs, max_query_len, np.float32, scale=0.3)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_all_padding_gives_zeros(kernel):
    """No sequence has queries: every token is padding."""
    inputs, _ = make_batch([(9, 2), (3, 1)], group=2, head_dims=(64, 64), block_size=16,
                           dtype=np.float32, seed=6)
    q, k_pool, v_pool, tables = inputs[:4]
    out = KERNELS[kernel](q, k_pool, v_pool, tables, jnp.zeros(2, jnp.int32),
                          jnp.zeros(3, jnp.int32), max_query_len=2)
    assert (np.asarray(out) == 0).all()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_bad_inputs_raise(kernel):
    inputs, max_query_len = make_batch([(9, 2), (3, 1)], group=2, head_dims=(64, 64),
                                       block_size=16, dtype=np.float32, seed=6)
    q, k_pool, v_pool, tables, lens, starts = inputs
    fn = functools.partial(KERNELS[kernel], max_query_len=max_query_len)
    with pytest.raises(ValueError, match="num_kv_heads"):
        fn(q[:, :3], k_pool, v_pool, tables, lens, starts)
    with pytest.raises(ValueError, match="head_dim"):  # the pool may be wider, not narrower
        fn(q, k_pool[..., :32], v_pool[..., :32], tables, lens, starts)
    with pytest.raises(ValueError, match="dtype"):
        fn(q.astype(jnp.bfloat16), k_pool, v_pool, tables, lens, starts)
    with pytest.raises(ValueError, match="seq_lens"):
        fn(q, k_pool, v_pool, tables, lens[:1], starts)
    with pytest.raises(ValueError, match="query_start_loc"):
        fn(q, k_pool, v_pool, tables, lens, starts[:2])
    with pytest.raises(ValueError, match="int32"):
        fn(q, k_pool, v_pool, tables.astype(jnp.int16), lens, starts)
    with pytest.raises(ValueError, match="max_query_len"):
        KERNELS[kernel](q, k_pool, v_pool, tables, lens, starts, max_query_len=0)


# --- TPU kernel specifics ------------------------------------------------------------------


# uneven chunks and 256-token compute blocks by default; one chunk and more chunks than
# tiles in the slow suite (each ~12 s under the TPU interpreter on a 2-core Zen 3)
@pytest.mark.parametrize("batch_chunks,pages_per_compute_block", [
    pytest.param(1, None, marks=pytest.mark.slow), (3, 16),
    pytest.param(64, None, marks=pytest.mark.slow),
])
def test_tpu_chunks_and_compute_blocks(batch_chunks, pages_per_compute_block):
    """The cross-tile prefetch stays consistent however the tiles are dealt to chunks."""
    inputs, max_query_len = make_batch(mixed_batch_spec(16), group=4, head_dims=(128, 128),
                                       block_size=16, dtype=np.float32, seed=4)
    out = ragged_paged_attention_tpu(*inputs, max_query_len=max_query_len,
                                     batch_chunks=batch_chunks,
                                     pages_per_compute_block=pages_per_compute_block,
                                     interpret=True)
    assert_matches(out, inputs, max_query_len, np.float32)


def test_tpu_many_kv_heads_loop():
    """More KV heads than the kernel unrolls: the heads loop instead."""
    inputs, max_query_len = make_batch([(40, 9), (0, 0), (17, 1)], group=1,
                                       head_dims=(64, 128), block_size=16, dtype=np.float32,
                                       seed=8, num_kv_heads=MAX_UNROLLED_HEADS + 1)
    out = ragged_paged_attention_tpu(*inputs, max_query_len=max_query_len, interpret=True)
    assert_matches(out, inputs, max_query_len, np.float32)


def test_tpu_bad_compute_block_raises():
    inputs, max_query_len = make_batch([(9, 2)], group=2, head_dims=(64, 64), block_size=16,
                                       dtype=np.float32, seed=6)
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        ragged_paged_attention_tpu(*inputs, max_query_len=max_query_len,
                                   pages_per_compute_block=3, interpret=True)


# --- lowering for TPU, on this CPU machine -------------------------------------------------

# (num_heads, num_kv_heads, head_dim, pool head_dim, block_size, tokens, max_query_len,
# sequences, blocks per sequence, pool blocks), all bf16
EXPORT_SHAPES = {
    # SmolLM2-135M: GQA group 3, head_dim 64 in a pool padded to 128 lanes, a mixed step
    "smollm2_mixed": (9, 3, 64, 128, 32, 256, 256, 16, 64, 1024),
    # Llama-3-8B: a mixed step and a pure-decode step
    "llama3_8b_mixed": (32, 8, 128, 128, 32, 256, 256, 16, 64, 1024),
    "llama3_8b_decode": (32, 8, 128, 128, 32, 64, 1, 64, 64, 4096),
    # 16 KV heads: more than the kernel unrolls, the heads loop
    "mha16_mixed": (16, 16, 128, 128, 16, 128, 128, 8, 64, 1024),
}
TENSOR_TYPE = re.compile(r"tensor<((?:\d+x)+)[a-z]\w*>")


def tensor_sizes(line: str) -> list[int]:
    return [int(np.prod([int(d) for d in dims.rstrip("x").split("x")]))
            for dims in TENSOR_TYPE.findall(line)]


@pytest.mark.parametrize("name", sorted(EXPORT_SHAPES))
def test_tpu_kernel_lowers_for_tpu(name):
    """Pallas -> Mosaic MLIR in a tpu_custom_call that takes the pools as they are: no op
    but the kernel touches a pool-sized tensor (no pad, concatenate or transpose of a pool;
    the D 64 -> 128 lanes padding is the queries'). Mosaic's own layout passes run later,
    in libtpu's compiler, so they are not exercised."""
    (num_heads, num_kv_heads, head_dim, pool_dim, block_size, num_tokens, max_query_len,
     num_seqs, width, num_blocks) = EXPORT_SHAPES[name]
    bf16, i32 = jnp.bfloat16, jnp.int32
    pool = jax.ShapeDtypeStruct((num_kv_heads, num_blocks, block_size, pool_dim), bf16)
    args = (jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), bf16), pool, pool,
            jax.ShapeDtypeStruct((num_seqs, width), i32), jax.ShapeDtypeStruct((num_seqs,), i32),
            jax.ShapeDtypeStruct((num_seqs + 1,), i32))
    kernel = functools.partial(ragged_paged_attention_tpu, max_query_len=max_query_len)
    exported = jax.export.export(jax.jit(kernel), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    module = exported.mlir_module()
    calls = [line for line in module.splitlines() if "custom_call @tpu_custom_call" in line]
    assert len(calls) == 1
    pool_type = f"tensor<{num_kv_heads}x{num_blocks}x{block_size}x{pool_dim}xbf16>"
    assert calls[0].count(pool_type) == 2  # K and V pools, as they came
    pool_size = int(np.prod(pool.shape))
    ops = [line for line in module.splitlines()
           if "stablehlo." in line and "@tpu_custom_call" not in line]
    assert any("stablehlo.transpose" in line for line in ops)  # the parse sees the q tiles'
    for line in ops:
        assert max(tensor_sizes(line), default=0) < pool_size, line[:300]


# --- quantized pools (pallas_kernels/quantized.py) -----------------------------------------

# (query heads per KV head, KV heads, (q head_dim, pool head_dim), block_size, longest
# cached context, longest chunk): prefill chunks and decode tokens in every batch
QUANTIZED_CASES = {
    # SmolLM2-135M's heads, head_dim 64 in a pool allocated at 128 lanes (zeros past 64),
    # contexts over several compute blocks
    "gqa3_64in128_b32": (3, 3, (64, 128), 32, 300, 40),
    # head_dim 80 in an 80-wide pool, padded inside both wrappers
    "mha_80_b32": (1, 2, (80, 80), 32, 40, 20),
    # 16-token blocks: GPU only (the TPU kernel wants 8-bit pages of whole (32, 128) tiles)
    "gqa4_64_b16": (4, 2, (64, 64), 16, 60, 20),
}
QUANTIZED_KERNEL_CASES = [(kernel, case) for kernel in sorted(KERNELS)
                          for case in sorted(QUANTIZED_CASES)
                          if kernel == "gpu" or QUANTIZED_CASES[case][3] % 32 == 0]


def widen_pool(pool, pool_dim):
    """A pool zero-padded to `pool_dim` lanes, as the engine allocates them (a QuantizedPool
    pads its values: zeros dequantize to zeros; its scales have no head dim)."""
    pad = ((0, 0), (0, 0), (0, 0), (0, pool_dim - pool.shape[3]))
    if quantized.is_quantized(pool):
        return quantized.QuantizedPool(jnp.pad(pool.values, pad), pool.scales)
    return np.pad(pool, pad)


def ragged_quantized_batch(seed, fmt, case):
    """`quantized_batch` (NaN scales in unowned slots) for a QUANTIZED_CASES row, its pools
    widened to the row's pool head dim. Returns (args with QuantizedPools, args with their
    float32 dequantization, max_query_len, keys, values). The first seed from `seed` on
    whose batch holds both prefill chunks and decode tokens."""
    group, num_kv_heads, (head_dim, pool_dim), block_size, max_cached, max_new = case
    for batch_seed in itertools.count(seed):
        args_q, args_f, keys, values = quantized_batch(
            np.random.default_rng(batch_seed), fmt, num_heads=group * num_kv_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            max_cached=max_cached, max_new=max_new, num_seqs=5)
        query_lens = np.diff(args_q[5])
        if query_lens.max() > 1 and query_lens.min() == 1:
            break
    args_q, args_f = ((a[0], widen_pool(a[1], pool_dim), widen_pool(a[2], pool_dim), *a[3:])
                      for a in (args_q, args_f))
    return args_q, args_f, int(np.diff(args_q[5]).max()), keys, values


@pytest.mark.parametrize("kernel,case,fmt", one_format_each(QUANTIZED_KERNEL_CASES))
def test_quantized_pools_read_as_their_dequantization(kernel, case, fmt):
    """On QuantizedPools a kernel's output is, bit for bit, its output on the float32 pools
    they dequantize to (tiles dequantized as loaded, the same math after), NaN scales in
    unowned slots never reach it, and both are within float32 rounding of a float64 oracle."""
    args_q, args_f, max_query_len, keys, values = ragged_quantized_batch(
        len(case) + len(fmt), fmt, QUANTIZED_CASES[case])
    out_q = KERNELS[kernel](*args_q, max_query_len=max_query_len)
    out_f = KERNELS[kernel](*args_f, max_query_len=max_query_len)
    assert_exact_and_near_oracle(out_q, out_f, args_q, keys, values,
                                 QUANTIZED_CASES[case][2][0]**-0.5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_quantized_pools_with_window_and_soft_cap(kernel):
    """Sliding window and soft cap on float8_e4m3fn pools: bitwise the float32 pools'
    output, and near the jnp reference on them."""
    args_q, args_f, max_query_len, _, _ = ragged_quantized_batch(
        12, "float8_e4m3fn", QUANTIZED_CASES["gqa3_64in128_b32"])
    options = dict(max_query_len=max_query_len, sliding_window=37, soft_cap=4.0)
    out_q = np.asarray(KERNELS[kernel](*args_q, **options))
    out_f = np.asarray(KERNELS[kernel](*args_f, **options))
    assert np.isfinite(out_q).all()
    np.testing.assert_array_equal(out_q, out_f)
    expected = jnp_reference(*args_f, **options)
    np.testing.assert_allclose(out_q, np.asarray(expected), atol=2e-5, rtol=0)


def test_tpu_many_kv_heads_loop_on_quantized_pools():
    """More KV heads than the TPU kernel unrolls: the heads loop, dequantizing the head of
    a traced index."""
    case = (1, MAX_UNROLLED_HEADS + 1, (64, 128), 32, 40, 20)
    args_q, args_f, max_query_len, keys, values = ragged_quantized_batch(3, "int8", case)
    out_q = ragged_paged_attention_tpu(*args_q, max_query_len=max_query_len, interpret=True)
    out_f = ragged_paged_attention_tpu(*args_f, max_query_len=max_query_len, interpret=True)
    assert_exact_and_near_oracle(out_q, out_f, args_q, keys, values, 64**-0.5)


def test_tpu_quantized_block_rule():
    """8-bit pools on TPU: block_size must be a multiple of 32 (Mosaic's (32, 128) tile)."""
    args_q, _, max_query_len, _, _ = ragged_quantized_batch(
        0, "float8_e5m2", QUANTIZED_CASES["gqa4_64_b16"])
    with pytest.raises(ValueError, match=r"block_size 16 .*float8_e5m2.*multiple of 32"):
        ragged_paged_attention_tpu(*args_q, max_query_len=max_query_len, interpret=True)


# SmolLM2-135M, a mixed step: 9 query / 3 KV heads, head_dim 64, 256 tokens of 16 sequences
SMOLLM2_MIXED = dict(num_tokens=256, max_query_len=256, num_seqs=16, num_heads=9,
                     num_kv_heads=3, head_dim=64, blocks_per_seq=64)


def smollm2_quantized_shapes(fmt, block_size, pool_dim):
    """Abstract arguments of a SmolLM2-135M mixed step: bf16 queries over QuantizedPools of
    `fmt` allocated at `pool_dim` lanes."""
    p = SMOLLM2_MIXED
    num_blocks = p["num_seqs"] * p["blocks_per_seq"] + 1
    shape = (p["num_kv_heads"], num_blocks, block_size, pool_dim)
    pool = quantized.QuantizedPool(jax.ShapeDtypeStruct(shape, jnp.dtype(fmt)),
                                   jax.ShapeDtypeStruct(shape[:-1], jnp.float32))
    i32 = jnp.int32
    return (jax.ShapeDtypeStruct((p["num_tokens"], p["num_heads"], p["head_dim"]), jnp.bfloat16),
            pool, pool, jax.ShapeDtypeStruct((p["num_seqs"], p["blocks_per_seq"]), i32),
            jax.ShapeDtypeStruct((p["num_seqs"],), i32),
            jax.ShapeDtypeStruct((p["num_seqs"] + 1,), i32))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_gpu_kernel_lowers_for_cuda_on_quantized_pools(fmt, block_size):
    """Values (8-bit) and scales go to the Triton call as they are: no dequantized pool."""
    args = smollm2_quantized_shapes(fmt, block_size, gpu_pool_head_dim(64))
    kernel = functools.partial(ragged_paged_attention_gpu,
                               max_query_len=SMOLLM2_MIXED["max_query_len"])
    check_cuda_quantized_lowering(kernel, args, fmt)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_tpu_kernel_lowers_for_tpu_on_quantized_pools(fmt, block_size):
    """32-token blocks lower to one tpu_custom_call taking the 8-bit values as they are (and
    the scales block-major); 16-token blocks are refused by the block-size rule."""
    args = smollm2_quantized_shapes(fmt, block_size, tpu_pool_head_dim(64))
    kernel = functools.partial(ragged_paged_attention_tpu,
                               max_query_len=SMOLLM2_MIXED["max_query_len"])
    check_tpu_quantized_lowering(kernel, args, fmt, block_size)
