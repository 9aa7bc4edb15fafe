"""cpu_ops.small_matmul (cpu/matmul_small.h's JaxpageSmallMatmul) against a float64 NumPy
oracle, and the model's matmuls (`jaxpage.layers.linear`) routed through it on CPU for few
rows.

Tolerance: the kernel multiplies and sums in float32 (bfloat16 inputs widened exactly, their
products exact in float32), so each output is within the classic bound of a float32 dot
product, |err| <= (K + 1) * 2^-24 * sum_k |x[m, k]| |w[k, n]| (one rounding per product and
per addition, in any order). `bound` takes K + 2 for margin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage import layers
from pallas_kernels import cpu_library, cpu_ops

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_ops.available(),
                                 reason="the CPU kernel library is not available")]

DTYPES = [jnp.float32, jnp.bfloat16]
# (dtype, bf16_dot): bfloat16 on both paths (the dot one is the portable one where the build
# has no AVX512-BF16)
MODES = [(jnp.float32, None), (jnp.bfloat16, True), (jnp.bfloat16, False)]
MODE_IDS = ["float32", "bfloat16-dot", "bfloat16-portable"]
# (K, N): odd sizes (no full vector, a vector and a tail, tile tails), K over several chunks
# of rows with N over several units of tiles and a tail (99, 1100), and SmolLM2-135M's
# projections qkv, o, gate_up, down
SHAPES = [(7, 7), (33, 33), (1, 5), (16, 16), (17, 100), (40, 65), (99, 1100), (576, 960),
          (576, 576), (576, 3072), (1536, 576)]


def operands(rng, m, k, n, dtype, transpose_w):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), dtype)
    return x, w


def oracle(x, w, transpose_w):
    """(x @ w in float64, sum |x| |w| in float64), with IEEE's inf and NaN rules (no BLAS)."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64)
    w64 = w64.T if transpose_w else w64
    total, magnitude = [], []
    # columns a chunk at a time: [M, K, N] products of a head's 49152 columns would be 1.8 GB
    for start in range(0, w64.shape[1], 2048):
        with np.errstate(invalid="ignore"):
            products = x64[:, :, None] * w64[None, :, start:start + 2048]  # [M, K, <=2048]
            total.append(products.sum(axis=1))
            magnitude.append(np.abs(products).sum(axis=1))
    return np.concatenate(total, axis=1), np.concatenate(magnitude, axis=1)


def bound(k, magnitude):
    return (k + 2) * 2.0**-24 * magnitude + 1e-30


def check(out, x, w, transpose_w):
    expected, magnitude = oracle(x, w, transpose_w)
    out = np.asarray(out)
    assert out.dtype == np.float32 and out.shape == expected.shape
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    np.testing.assert_array_equal(np.isposinf(out), np.isposinf(expected))
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(expected))
    finite = np.isfinite(expected)
    err = np.abs(out[finite] - expected[finite])
    assert np.all(err <= bound(x.shape[1], magnitude[finite])), err.max()


@pytest.mark.parametrize("dtype,bf16_dot", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("transpose_w", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_small_matmul_matches_float64(dtype, bf16_dot, transpose_w, k, n):
    rng = np.random.default_rng(k * 1000 + n)
    for m in range(1, 17):
        if k * n > 100_000 and m not in (1, 4, 5, 8, 9, 16):  # keep the big shapes quick
            continue
        x, w = operands(rng, m, k, n, dtype, transpose_w)
        out = cpu_ops.small_matmul(x, w, transpose_w=transpose_w, bf16_dot=bf16_dot)
        check(out, x, w, transpose_w)


@pytest.mark.parametrize("dtype,bf16_dot", MODES, ids=MODE_IDS)
def test_tied_lm_head_shape(dtype, bf16_dot):
    """SmolLM2's tied head: [8, 576] x [49152, 576]^T, under jit."""
    rng = np.random.default_rng(1)
    x, w = operands(rng, 8, 576, 49152, dtype, True)
    out = jax.jit(lambda x, w: cpu_ops.small_matmul(x, w, transpose_w=True,
                                                          bf16_dot=bf16_dot))(x, w)
    check(out, x, w, True)


@pytest.mark.parametrize("dtype,bf16_dot", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("transpose_w", [False, True], ids=["KN", "NK"])
def test_nan_and_inf_propagate(dtype, bf16_dot, transpose_w):
    rng = np.random.default_rng(2)
    m, k, n = 9, 69, 70  # vector parts and tails in both K and N, an odd K
    x, w = operands(rng, m, k, n, dtype, transpose_w)
    x = x.at[2, 5].set(jnp.nan).at[4, 68].set(jnp.inf)  # a vector lane and the K tail
    if transpose_w:
        w = w.at[3, 1].set(jnp.inf).at[69, 20].set(-jnp.inf).at[40, 33].set(jnp.nan)
    else:
        w = w.at[1, 3].set(jnp.inf).at[20, 69].set(-jnp.inf).at[33, 40].set(jnp.nan)
    out = cpu_ops.small_matmul(x, w, transpose_w=transpose_w, bf16_dot=bf16_dot)
    check(out, x, w, transpose_w)
    assert np.isnan(np.asarray(out)[2]).all()


def test_empty_and_zero_k():
    x = jnp.zeros((3, 0), jnp.float32)
    w = jnp.zeros((0, 5), jnp.float32)
    np.testing.assert_array_equal(cpu_ops.small_matmul(x, w), np.zeros((3, 5)))
    out = cpu_ops.small_matmul(jnp.zeros((0, 4)), jnp.ones((4, 6)))
    assert out.shape == (0, 6)


def test_bad_operands_are_rejected():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="does not contract"):
        cpu_ops.small_matmul(x, jnp.ones((7, 3), jnp.float32))
    with pytest.raises(ValueError, match="does not contract"):
        cpu_ops.small_matmul(x, jnp.ones((8, 3), jnp.float32), transpose_w=True)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_ops.small_matmul(x, jnp.ones((8, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        cpu_ops.small_matmul(x.astype(jnp.float16), jnp.ones((8, 3), jnp.float16))
    with pytest.raises(ValueError, match="matrices"):
        cpu_ops.small_matmul(x[None], jnp.ones((8, 3), jnp.float32))


@pytest.mark.parametrize("operands_, out_shape, message", [
    ((np.ones((2, 8), np.float32), np.ones((7, 3), np.float32)), (2, 3), "does not contract"),
    ((np.ones((2, 8), np.float32), np.ones((8, 3), np.float32)), (2, 4), "output"),
    ((np.ones((2, 8), np.float32), np.ones((8, 3), jnp.bfloat16)), (2, 3), "one dtype"),
    ((np.ones((2, 8), np.float16), np.ones((8, 3), np.float16)), (2, 3), "float16"),
    ((np.ones((2, 2, 8), np.float32), np.ones((8, 3), np.float32)), (2, 3), "matrices"),
])
def test_the_handler_rejects_what_the_wrapper_would(operands_, out_shape, message):
    """The C++ handler checks shapes and dtypes itself (an ffi_call past the wrapper)."""
    cpu_ops.available()
    call = jax.ffi.ffi_call(cpu_library.TARGET_SMALL_MATMUL,
                            jax.ShapeDtypeStruct(out_shape, jnp.float32))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(call(*operands_, transpose_w=np.int64(0), bf16_dot=np.int64(1)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rows", [8, 16])
def test_linear_takes_the_kernel_on_cpu_and_equals_the_jnp_path(dtype, rows):
    rng = np.random.default_rng(3)
    x, w = operands(rng, rows, 576, 960, dtype, False)
    hlo = jax.jit(layers.linear).lower(x, w).as_text()
    # the kernel where the library is built for AVX-512; else XLA's dot (faster there)
    assert ("jaxpage_small_matmul" in hlo) == cpu_ops.wide_vectors()
    out32 = jax.jit(layers.matmul_f32)(x, w)
    jnp32 = jnp.dot(x, w, preferred_element_type=jnp.float32)
    _, magnitude = oracle(x, w, False)
    # both within the float32 bound of the exact product, so within twice it of each other
    assert np.all(np.abs(np.asarray(out32) - np.asarray(jnp32)) <= 2 * bound(576, magnitude))
    check(out32, x, w, False)
    out = np.asarray(jax.jit(layers.linear)(x, w), np.float32)
    ref = np.asarray(jnp32.astype(dtype), np.float32)
    assert jax.jit(layers.linear)(x, w).dtype == dtype
    # rounded once to x's dtype: at most one ulp of it apart (a float32 difference that
    # straddles a rounding boundary)
    ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-23
    assert np.all(np.abs(out - ref) <= ulp * np.abs(ref) + 2 * bound(576, magnitude))


def test_tied_head_and_many_rows_and_other_platforms():
    rng = np.random.default_rng(4)
    x, w = operands(rng, 8, 64, 300, jnp.bfloat16, True)
    head = jax.jit(lambda x, w: layers.matmul_f32(x, w, transpose_w=True))
    wide = cpu_ops.wide_vectors()  # the kernel only where built for AVX-512
    assert ("jaxpage_small_matmul" in head.lower(x, w).as_text()) == wide
    check(head(x, w), x, w, True)
    # up to SMALL_MATMUL_ROWS of the dtype and layout the kernel, one row more the jnp dot
    for (dtype_name, transpose_w), rows in layers.SMALL_MATMUL_ROWS.items():
        for m, kernel in ((rows, True), (rows + 1, False)):
            xm, wm = operands(rng, m, 64, 32, jnp.dtype(dtype_name), transpose_w)
            step = jax.jit(lambda x, w, t=transpose_w: layers.matmul_f32(x, w, transpose_w=t))
            assert ("jaxpage_small_matmul" in step.lower(xm, wm).as_text()) == (kernel and wide)
            if kernel:
                check(step(xm, wm), xm, wm, transpose_w)
    # exported for an accelerator, the CPU branch is gone
    x8, w8 = operands(rng, 8, 64, 32, jnp.float32, False)
    exported = jax.export.export(jax.jit(layers.linear), platforms=["cuda"])(x8, w8)
    assert "jaxpage_small_matmul" not in exported.mlir_module()
