"""The paged decode kernels (GPU Triton, TPU Mosaic) against the pure-jnp reference.

On CPU both kernels run in Pallas interpret mode (the TPU one under the TPU interpreter, which
simulates DMAs and semaphores, fills uninitialized VMEM with NaN and raises on out-of-bounds
reads). Every batch mixes lengths 1, block_size - 1, block_size, block_size + 1, a random
length up to 2k and padding rows, over permuted block tables, with NaN in every pool slot no
sequence owns. The fast set covers every pair of (query heads per KV head, head_dim, block
size, dtype); the `slow` set is the full product. The lowering tests export each kernel for
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

from pallas_kernels import paged_decode_gpu
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.paged_decode_tpu import paged_decode_attention_tpu
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
# (group, head_dim, block_size, dtype): every pair of values of any two factors appears
# (checked by test_covering_set_covers_every_pair), in 9 rows instead of 36.
COVERING_SET = [
    (1, 64, 8, "f32"), (1, 64, 16, "f32"), (1, 128, 32, "bf16"),
    (3, 64, 8, "f32"), (3, 64, 16, "bf16"), (3, 128, 32, "f32"),
    (8, 128, 8, "bf16"), (8, 128, 16, "f32"), (8, 64, 32, "f32"),
]
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


def test_covering_set_covers_every_pair():
    factors = (GROUPS, HEAD_DIMS, BLOCK_SIZES, tuple(DTYPES))
    for i, j in itertools.combinations(range(len(factors)), 2):
        wanted = set(itertools.product(factors[i], factors[j]))
        assert wanted == {(row[i], row[j]) for row in COVERING_SET}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("group,head_dim,block_size,dtype_name", COVERING_SET)
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


@pytest.mark.parametrize("batch_chunks,pages_per_compute_block", [
    (1, None), (3, 16), (8, None),  # one chunk; uneven chunks, 256-token blocks; > S chunks
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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_lowers_for_cuda(dtype):
    targets = set(TRITON_TARGETS) | {getattr(paged_decode_gpu.pltriton, "CUSTOM_CALL_TARGET_NAME",
                                             TRITON_TARGETS[0])}
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(targets)]
    try:
        with abstract_gpu_context():
            exported = jax.export.export(
                jax.jit(paged_decode_attention_gpu), platforms=["cuda"],
                disabled_checks=checks)(*production_shapes(dtype))
    except RuntimeError as error:
        if "does not have a Triton compilation handler" in str(error):
            # jaxlib > 0.10.2 with the new custom call compiles Triton IR to PTX during
            # lowering through a handler that only the CUDA plugin (jax-cuda*-plugin)
            # registers (jax/_src/lib/triton.py): not installed on a CPU-only machine.
            pytest.skip("Triton->PTX compilation handler is registered by the CUDA plugin, "
                        f"absent on this CPU machine: {error}")
        raise
    module = exported.mlir_module()
    called = set(re.findall(r"custom_call @([\w$.]+)", module))
    assert called & targets, called
    grid = dict(re.findall(r"grid_([xyz]) = (\d+)", module))
    if grid:  # IR path: (sequence, KV head, split) = (8, 8, splits)
        assert grid["x"] == "8" and grid["y"] == "8"
    assert exported.platforms == ("cuda",)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tpu_kernel_lowers_for_tpu(dtype):
    """Pallas -> Mosaic MLIR in a tpu_custom_call (a stable target, no check to disable).
    Mosaic's own layout passes run later, in libtpu's compiler, so they are not exercised."""
    exported = jax.export.export(
        jax.jit(paged_decode_attention_tpu), platforms=["tpu"])(*production_shapes(dtype))
    module = exported.mlir_module()
    assert "custom_call @tpu_custom_call" in module
    assert exported.platforms == ("tpu",)
