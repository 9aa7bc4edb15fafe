"""The paged decode kernels (GPU Triton, TPU Mosaic) against the pure-jnp reference.

On CPU both kernels run in Pallas interpret mode (the TPU one under the TPU interpreter, which
simulates DMAs and semaphores, fills uninitialized VMEM with NaN and raises on out-of-bounds
reads). Every batch mixes lengths 1, block_size - 1, block_size, block_size + 1, a random
length up to 2k and padding rows, over permuted block tables, with NaN in every pool slot no
sequence owns. The fast set runs every value of each of (query heads per KV head, head_dim,
block size, dtype); the `slow` set is the full product. The lowering tests export each kernel for
its real platform at production shapes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quantized_kv import assert_exact_and_near_oracle, one_format_each, quantized_batch

from pallas_kernels import paged_decode_gpu, quantized
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.paged_decode_tpu import paged_decode_attention_tpu
from pallas_kernels.ragged_paged_gpu import pool_head_dim as gpu_pool_head_dim
from pallas_kernels.ragged_paged_tpu import pool_head_dim as tpu_pool_head_dim
from pallas_kernels.reference import paged_attention_reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings(
        f"ignore:{paged_decode_gpu.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning"),
]

KERNELS = {
    "gpu": functools.partial(paged_decode_attention_gpu, interpret=True),
    "tpu": functools.partial(paged_decode_attention_tpu, interpret=True),
}
TOLERANCE = {np.float32: 1e-5, jnp.bfloat16: 2e-2}
DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16}
NUM_KV_HEADS = 2
MAX_RANDOM_LENGTH = 2048

GROUPS = (1, 3, 8)  # query heads per KV head
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32)
# (group, head_dim, block_size, dtype): the default suite runs every value of every factor
# at least once (checked by test_each_level_runs_by_default), in 3 rows; the slow suite the
# full product of 36 (a pairwise covering set of 9 rows ran by default until the suite passed
# 23 minutes on a 2-core Zen 3).
EACH_LEVEL = [(1, 64, 8, "f32"), (3, 128, 32, "bf16"), (8, 128, 16, "f32")]
FULL_PRODUCT = list(itertools.product(GROUPS, HEAD_DIMS, BLOCK_SIZES, DTYPES))


def edge_lengths(block_size: int, rng: np.random.Generator) -> list[int]:
    """One batch's lengths: every edge case, a random long one, and padding rows (0)
    between them, so that chunks of the batch hold empty sequences to skip."""
    random_length = int(rng.integers(2 * block_size + 2, MAX_RANDOM_LENGTH + 1))
    return [block_size + 1, 0, 1, block_size, random_length, block_size - 1, 0]


def make_batch(lengths, *, group, head_dim, block_size, dtype, seed=0,
               num_kv_heads=NUM_KV_HEADS, extra_blocks=3):
    """Random decode inputs over a pool whose unowned slots are all NaN.

    Returns q [S, H, D], k_pool and v_pool [K, N, B, D], block_tables [S, W] (a random
    permutation of the blocks; padding entries point at block 0, which is never owned) and
    seq_lens [S].
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    num_pages = -(-lengths // block_size)
    width = int(num_pages.max()) + 1  # one padding column at least
    num_blocks = 1 + int(num_pages.sum()) + extra_blocks
    pool_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pool = np.full(pool_shape, np.nan, np.float32)
    v_pool = np.full(pool_shape, np.nan, np.float32)
    block_ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(lengths), width), np.int32)
    used = 0
    for seq, (length, pages) in enumerate(zip(lengths, num_pages, strict=True)):
        tables[seq, :pages] = block_ids[used:used + pages]
        used += pages
        for page in range(pages):
            count = min(block_size, length - page * block_size)
            block = tables[seq, page]
            k_pool[:, block, :count] = rng.standard_normal((num_kv_heads, count, head_dim))
            v_pool[:, block, :count] = rng.standard_normal((num_kv_heads, count, head_dim))
    # x2 so that softmaxes are peaked rather than near uniform
    q = 2 * rng.standard_normal((len(lengths), num_kv_heads * group, head_dim))
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return cast(q), cast(k_pool), cast(v_pool), jnp.asarray(tables), jnp.asarray(lengths)


def reference(q, k_pool, v_pool, block_tables, seq_lens, scale=None):
    """The oracle for pure decode: one query per sequence."""
    query_start_loc = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens,
                                     query_start_loc, max_query_len=1, scale=scale)


def assert_matches_reference(out, inputs, dtype, scale=None):
    expected = reference(*inputs, scale=scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, np.asarray(expected.astype(jnp.float32)), atol=tol, rtol=tol)
    padding = np.asarray(inputs[4]) == 0
    assert (out[padding] == 0).all()


def run_case(kernel, group, head_dim, block_size, dtype_name, seed):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    lengths = edge_lengths(block_size, rng)
    inputs = make_batch(lengths, group=group, head_dim=head_dim, block_size=block_size,
                        dtype=dtype, seed=seed)
    out = KERNELS[kernel](*inputs)
    assert_matches_reference(out, inputs, dtype)


def test_each_level_runs_by_default():
    factors = (GROUPS, HEAD_DIMS, BLOCK_SIZES, tuple(DTYPES))
    for i, levels in enumerate(factors):
        assert set(levels) == {row[i] for row in EACH_LEVEL}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("group,head_dim,block_size,dtype_name", EACH_LEVEL)
def test_matches_reference(kernel, group, head_dim, block_size, dtype_name):
    run_case(kernel, group, head_dim, block_size, dtype_name, seed=group * 1000 + block_size)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("group,head_dim,block_size,dtype_name", FULL_PRODUCT)
def test_matches_reference_full_product(kernel, group, head_dim, block_size, dtype_name):
    run_case(kernel, group, head_dim, block_size, dtype_name, seed=7 + group + block_size)


@pytest.mark.parametrize("num_splits,pages_per_compute_block", [
    (1, 1), (4, None), (64, 2),  # one split; a few; more splits than compute blocks
])
def test_gpu_splits_and_compute_blocks(num_splits, pages_per_compute_block):
    """The flash-decoding combine is exact whatever the split count and step size."""
    inputs = make_batch([700, 0, 17, 1, 256], group=4, head_dim=64, block_size=16,
                        dtype=np.float32, seed=3)
    out = paged_decode_attention_gpu(*inputs, num_splits=num_splits,
                                     pages_per_compute_block=pages_per_compute_block,
                                     interpret=True)
    assert_matches_reference(out, inputs, np.float32)


# uneven chunks and 256-token compute blocks by default; one chunk and more chunks than
# sequences in the slow suite (each ~9 s under the TPU interpreter on a 2-core Zen 3)
@pytest.mark.parametrize("batch_chunks,pages_per_compute_block", [
    pytest.param(1, None, marks=pytest.mark.slow), (3, 16),
    pytest.param(8, None, marks=pytest.mark.slow),
])
def test_tpu_chunks_and_compute_blocks(batch_chunks, pages_per_compute_block):
    """Cross-sequence prefetch stays consistent over chunk boundaries and empty rows."""
    inputs = make_batch([700, 0, 0, 17, 1, 256, 0], group=4, head_dim=128, block_size=16,
                        dtype=np.float32, seed=4)
    out = paged_decode_attention_tpu(*inputs, batch_chunks=batch_chunks,
                                     pages_per_compute_block=pages_per_compute_block,
                                     interpret=True)
    assert_matches_reference(out, inputs, np.float32)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_custom_scale_and_odd_head_dim(kernel):
    """head_dim 80 (padded inside the wrapper) and an explicit softmax scale."""
    inputs = make_batch([33, 5, 0], group=2, head_dim=80, block_size=16, dtype=np.float32,
                        seed=5)
    out = KERNELS[kernel](*inputs, scale=0.3)
    assert_matches_reference(out, inputs, np.float32, scale=0.3)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_all_padding_rows_give_zeros(kernel):
    q, k_pool, v_pool, tables, _ = make_batch([9, 3], group=2, head_dim=64, block_size=8,
                                              dtype=np.float32, seed=6)
    out = KERNELS[kernel](q, k_pool, v_pool, tables, jnp.zeros(2, jnp.int32))
    assert (np.asarray(out) == 0).all()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_bad_inputs_raise(kernel):
    q, k_pool, v_pool, tables, lens = make_batch([9, 3], group=2, head_dim=64, block_size=8,
                                                 dtype=np.float32, seed=6)
    fn = KERNELS[kernel]
    with pytest.raises(ValueError, match="num_kv_heads"):
        fn(q[:, :3], k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match="head_dim"):
        fn(q[..., :32], k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match="dtype"):
        fn(q.astype(jnp.bfloat16), k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match="seq_lens"):
        fn(q, k_pool, v_pool, tables, lens[:1])
    with pytest.raises(ValueError, match="int32"):
        fn(q, k_pool, v_pool, tables.astype(jnp.int16), lens)
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        fn(q, k_pool, v_pool, tables, lens, pages_per_compute_block=3)


# --- lowering for the real platforms, on this CPU machine ---------------------------------

# Production decode shapes: batch 8, 64 blocks of 16 per sequence, 32 query / 8 KV heads.
PRODUCTION = dict(num_seqs=8, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                  blocks_per_seq=64)


def production_shapes(dtype=jnp.bfloat16):
    p = PRODUCTION
    num_blocks = p["num_seqs"] * p["blocks_per_seq"] + 1
    pool = jax.ShapeDtypeStruct(
        (p["num_kv_heads"], num_blocks, p["block_size"], p["head_dim"]), dtype)
    return (jax.ShapeDtypeStruct((p["num_seqs"], p["num_heads"], p["head_dim"]), dtype),
            pool, pool,
            jax.ShapeDtypeStruct((p["num_seqs"], p["blocks_per_seq"]), jnp.int32),
            jax.ShapeDtypeStruct((p["num_seqs"],), jnp.int32))


def abstract_gpu_context(device_kind="NVIDIA H200"):
    """From jax 0.11 the Triton lowering reads the target GPU from the device, or, with none
    attached, from the abstract mesh's `abstract_device`; it raises 'No supported GPU devices
    found' otherwise (jax/_src/pallas/triton/gpu_info.py). jax 0.10 falls back to sm_90 by
    itself (jax/_src/pallas/triton/pallas_call_registration.py)."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device is None:
        return contextlib.nullcontext()
    try:
        mesh = jax.sharding.AbstractMesh(
            (1,), ("x",), (jax.sharding.AxisType.Explicit,),
            abstract_device=abstract_device(device_kind, 1, "cuda"))
    except TypeError:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


# Pallas Triton custom-call targets: jaxlib <= 0.10.2 (and 0.11 by default) hand XLA the Triton
# IR ("__gpu$xla.gpu.triton"); later ones may compile to PTX at lowering
# ("triton_kernel_call_ffi"). Triton IR is not a stable format, so export refuses both unless
# told otherwise.
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


TRITON_CALL_TARGETS = set(TRITON_TARGETS) | {
    getattr(paged_decode_gpu.pltriton, "CUSTOM_CALL_TARGET_NAME", TRITON_TARGETS[0])}


def export_for_cuda(fn, *args):
    """jax.export of a Pallas Triton kernel for CUDA on this CPU machine: the module, after
    checking that it calls a Triton kernel (skips where lowering needs the CUDA plugin)."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(TRITON_CALL_TARGETS)]
    try:
        with abstract_gpu_context():
            exported = jax.export.export(
                jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
    except RuntimeError as error:
        if "does not have a Triton compilation handler" in str(error):
            # jaxlib > 0.10.2 with the new custom call compiles Triton IR to PTX during
            # lowering through a handler that only the CUDA plugin (jax-cuda*-plugin)
            # registers (jax/_src/lib/triton.py): not installed on a CPU-only machine.
            pytest.skip("Triton->PTX compilation handler is registered by the CUDA plugin, "
                        f"absent on this CPU machine: {error}")
        raise
    assert exported.platforms == ("cuda",)
    module = exported.mlir_module()
    called = set(re.findall(r"custom_call @([\w$.]+)", module))
    assert called & TRITON_CALL_TARGETS, called
    return module


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_lowers_for_cuda(dtype):
    module = export_for_cuda(paged_decode_attention_gpu, *production_shapes(dtype))
    grid = dict(re.findall(r"grid_([xyz]) = (\d+)", module))
    if grid:  # IR path: (sequence, KV head, split) = (8, 8, splits)
        assert grid["x"] == "8" and grid["y"] == "8"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tpu_kernel_lowers_for_tpu(dtype):
    """Pallas -> Mosaic MLIR in a tpu_custom_call (a stable target, no check to disable).
    Mosaic's own layout passes run later, in libtpu's compiler, so they are not exercised."""
    exported = jax.export.export(
        jax.jit(paged_decode_attention_tpu), platforms=["tpu"])(*production_shapes(dtype))
    module = exported.mlir_module()
    assert "custom_call @tpu_custom_call" in module
    assert exported.platforms == ("tpu",)


# --- quantized pools (pallas_kernels/quantized.py) -----------------------------------------

QUANTIZED_FORMATS = list(quantized.FORMATS)
# (query heads per KV head, KV heads, head_dim, block_size, longest cached context)
QUANTIZED_CASES = {
    # SmolLM2-135M's heads (head_dim 64: the TPU wrapper pads it to 128 lanes), contexts
    # over several compute blocks
    "gqa3_d64_b32": (3, 3, 64, 32, 300),
    # head_dim 80, padded inside both wrappers (128 lanes; a power of 2)
    "mha_d80_b32": (1, 2, 80, 32, 40),
    # 16-token blocks: GPU only (the TPU kernel wants 8-bit pages of whole (32, 128) tiles)
    "gqa4_d64_b16": (4, 2, 64, 16, 60),
}


def decode_quantized_batch(seed, fmt, group, num_kv_heads, head_dim, block_size, max_cached):
    """`quantized_batch` (NaN scales in unowned slots) cut to decode: each sequence's last
    query. Returns (decode args with QuantizedPools, with their float32 dequantization,
    the ragged args of those queries for the oracle, keys, values)."""
    args_q, args_f, keys, values = quantized_batch(
        np.random.default_rng(seed), fmt, num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        max_cached=max_cached)
    q, _, _, tables, seq_lens, qsl = args_q
    q_last = q[qsl[1:] - 1]  # every sequence has >= 1 query; its last is at seq_len - 1
    oracle_args = (q_last, None, None, tables, seq_lens,
                   np.arange(len(seq_lens) + 1, dtype=np.int32))
    return ((q_last, *args_q[1:5]), (q_last, *args_f[1:5]), oracle_args, keys, values)


# every kernel and case but the TPU kernel on 16-token blocks (test_tpu_quantized_block_rule)
QUANTIZED_KERNEL_CASES = [(kernel, case) for kernel in sorted(KERNELS)
                          for case in sorted(QUANTIZED_CASES)
                          if kernel == "gpu" or QUANTIZED_CASES[case][3] % 32 == 0]


@pytest.mark.parametrize("kernel,case,fmt", one_format_each(QUANTIZED_KERNEL_CASES))
def test_quantized_pools_read_as_their_dequantization(kernel, case, fmt):
    """On QuantizedPools a kernel's output is, bit for bit, its output on the float32 pools
    they dequantize to (the tiles are dequantized as loaded, the math after is the same),
    NaN scales in unowned slots never reach it, and both are within float32 rounding of a
    float64 oracle."""
    group, num_kv_heads, head_dim, block_size, max_cached = QUANTIZED_CASES[case]
    args_q, args_f, oracle_args, keys, values = decode_quantized_batch(
        group + block_size, fmt, group, num_kv_heads, head_dim, block_size, max_cached)
    out_q = KERNELS[kernel](*args_q)
    out_f = KERNELS[kernel](*args_f)
    assert_exact_and_near_oracle(out_q, out_f, oracle_args, keys, values, head_dim**-0.5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_quantized_pools_with_window_and_soft_cap(kernel):
    """Sliding window and soft cap on int8 pools: bitwise the float32 pools' output, and
    near the jnp reference reading the quantized pools."""
    args_q, args_f, oracle_args, _, _ = decode_quantized_batch(11, "int8", 3, 3, 64, 32, 300)
    options = dict(sliding_window=37, soft_cap=4.0)
    out_q = np.asarray(KERNELS[kernel](*args_q, **options))
    out_f = np.asarray(KERNELS[kernel](*args_f, **options))
    assert np.isfinite(out_q).all()
    np.testing.assert_array_equal(out_q, out_f)
    expected = paged_attention_reference(
        oracle_args[0], *args_q[1:], oracle_args[5], max_query_len=1, **options)
    np.testing.assert_allclose(out_q, np.asarray(expected), atol=2e-5, rtol=0)


def test_tpu_quantized_block_rule():
    """8-bit pools on TPU: block_size must be a multiple of 32 (Mosaic's (32, 128) tile)."""
    args_q, _, _, _, _ = decode_quantized_batch(0, "int8", 1, 2, 64, 16, 40)
    with pytest.raises(ValueError, match=r"block_size 16 .*int8.*multiple of 32"):
        paged_decode_attention_tpu(*args_q, interpret=True)


def test_quantized_pools_raise_on_mixed_pools():
    args_q, args_f, _, _, _ = decode_quantized_batch(0, "int8", 1, 2, 64, 32, 40)
    q, k_pool, v_pool, tables, lens = args_q
    with pytest.raises(ValueError, match="both"):
        KERNELS["gpu"](q, k_pool, jnp.asarray(args_f[2]), tables, lens)
    other = quantized.QuantizedPool(v_pool.values.astype(jnp.float8_e4m3fn), v_pool.scales)
    with pytest.raises(ValueError, match="dtypes"):
        KERNELS["tpu"](q, k_pool, other, tables, lens)


# SmolLM2-135M decode: 9 query / 3 KV heads, head_dim 64, 16 sequences of up to 64 blocks
SMOLLM2 = dict(num_seqs=16, num_heads=9, num_kv_heads=3, head_dim=64, blocks_per_seq=64)


def smollm2_quantized_shapes(fmt, block_size, pool_dim):
    """Abstract decode arguments at SmolLM2-135M shapes: bf16 queries at the pool's head
    dim (the engine pads q to it) over QuantizedPools of `fmt`."""
    p = SMOLLM2
    num_blocks = p["num_seqs"] * p["blocks_per_seq"] + 1
    shape = (p["num_kv_heads"], num_blocks, block_size, pool_dim)
    pool = quantized.QuantizedPool(jax.ShapeDtypeStruct(shape, jnp.dtype(fmt)),
                                   jax.ShapeDtypeStruct(shape[:-1], jnp.float32))
    return (jax.ShapeDtypeStruct((p["num_seqs"], p["num_heads"], pool_dim), jnp.bfloat16),
            pool, pool,
            jax.ShapeDtypeStruct((p["num_seqs"], p["blocks_per_seq"]), jnp.int32),
            jax.ShapeDtypeStruct((p["num_seqs"],), jnp.int32))


def mlir_type(fmt) -> str:
    return {"int8": "i8", "float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}[fmt]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_gpu_kernel_lowers_for_cuda_on_quantized_pools(fmt, block_size):
    """Values (8-bit) and scales go to the Triton call as they are: no dequantized pool."""
    args = smollm2_quantized_shapes(fmt, block_size, gpu_pool_head_dim(SMOLLM2["head_dim"]))
    check_cuda_quantized_lowering(paged_decode_attention_gpu, args, fmt)


def check_cuda_quantized_lowering(kernel, args, fmt):
    """A GPU kernel on quantized pools lowers for CUDA with the 8-bit values as they came and
    no float32 array of the pool's shape."""
    module = export_for_cuda(kernel, *args)
    values_type = "x".join(map(str, args[1].values.shape)) + "x" + mlir_type(fmt)
    assert f"tensor<{values_type}>" in module
    assert f"{values_type.rsplit('x', 1)[0]}xf32" not in module  # no float32 pool


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_tpu_kernel_lowers_for_tpu_on_quantized_pools(fmt, block_size):
    """32-token blocks lower to one tpu_custom_call taking the 8-bit values as they are (and
    the scales block-major); 16-token blocks are refused by the block-size rule."""
    args = smollm2_quantized_shapes(fmt, block_size, tpu_pool_head_dim(SMOLLM2["head_dim"]))
    check_tpu_quantized_lowering(paged_decode_attention_tpu, args, fmt, block_size)


def check_tpu_quantized_lowering(kernel, args, fmt, block_size):
    """A TPU kernel on quantized pools at `block_size`: refused unless a multiple of 32, else
    one tpu_custom_call taking the 8-bit values as they came and the scales block-major."""
    export = jax.export.export(jax.jit(kernel), platforms=["tpu"])
    if block_size % 32:
        with pytest.raises(ValueError, match=f"block_size {block_size} .*multiple of 32"):
            export(*args)
        return
    exported = export(*args)
    assert exported.platforms == ("tpu",)
    calls = [line for line in exported.mlir_module().splitlines()
             if "custom_call @tpu_custom_call" in line]
    assert len(calls) == 1
    values_type = "x".join(map(str, args[1].values.shape)) + "x" + mlir_type(fmt)
    assert calls[0].count(f"tensor<{values_type}>") == 2  # K and V values, as they came
    k, n, b = args[1].scales.shape
    assert calls[0].count(f"tensor<{n}x{k}x{b}xf32>") == 2  # K and V scales, block-major
