"""A layer's elementwise glue on CPU (cpu/layer_glue.h's JaxpageAddRmsNorm, JaxpageSiluMul and
JaxpageQkvRope; `jaxpage.layers.add_rms_norm`, `silu_mul`, `split_rotate` take them on
CPU) against a float64 NumPy oracle and, where the kernel keeps XLA's roundings, bit for bit
against the jnp path the other platforms run.

Bounds (u = 2^-8 for bfloat16, 2^-24 for float32: the unit roundoff of each; a bfloat16 has 8
significant bits):
- add + RMSNorm: the sum is one rounding of x + T(delta), as XLA's, so exact. The norm
  w * T(s * r), r = 1 / sqrt(mean(s^2) + eps): the sum of H squares is within (H + 1) * 2^-24
  relative (positive terms, float32), the mean, sqrt and reciprocal add 3 * 2^-24 (half of the
  sum's error passes the sqrt), and the two roundings to T add u each: |out - w s r64| <=
  |w s r64| * (2 u + (H + 4) * 2^-24), plus 2^-126 for results near float32's underflow.
- SiLU and multiply: g and u rounded to T first (exact in the oracle, which takes them rounded),
  silu in float32 within 6 * 2^-24 relative (exp a few ulp, the division and the product), then
  two roundings to T: |out - silu64(g) u| <= |silu64(g) u| * (2 u + 6 * 2^-24) + 2^-126.
- qkv split and rope: each product and the sum rounded to T as XLA rounds them: bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpage import layers
from pallas_kernels import cpu_library, cpu_ops

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_ops.available(),
                                 reason="the CPU kernel library is not available")]

DTYPES = ["float32", "bfloat16"]
TINY = 2.0**-126


def unit(dtype) -> float:
    return 2.0**-8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0**-24


def rounded(x: np.ndarray, dtype) -> np.ndarray:
    """x rounded to dtype (nearest even), as float64."""
    t = ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.float32
    return np.asarray(x, np.float32).astype(t).astype(np.float64)


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def same_bits(a: jax.Array, b: jax.Array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)))


# (rows, hidden): a decode row, a few rows with a tail past the 16-lane vectors, SmolLM2's
# width at a decode bucket, and enough rows to share them among the threads
NORM_SHAPES = [(1, 576), (5, 37), (8, 576), (130, 576)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
@pytest.mark.parametrize("delta_kind", ["float32", "model dtype", "none"])
def test_add_rms_norm_sums_exactly_and_norms_within_the_bound(dtype, rows, hidden, delta_kind):
    rng = np.random.default_rng(rows * 100 + hidden)
    x = jnp.asarray(rng.standard_normal((rows, hidden)) * 2, dtype)
    delta = {"float32": jnp.asarray(rng.standard_normal((rows, hidden)) * 3, jnp.float32),
             "model dtype": jnp.asarray(rng.standard_normal((rows, hidden)) * 3, dtype),
             "none": None}[delta_kind]
    weight = jnp.asarray(rng.standard_normal(hidden), dtype)
    eps = 1e-5
    s, normed = jax.jit(cpu_ops.add_rms_norm, static_argnums=3)(x, delta, weight, eps)
    want_sum = x if delta is None else x + delta.astype(dtype)  # XLA's add: the jnp path's
    assert same_bits(s, want_sum)
    assert normed.dtype == jnp.dtype(dtype) and normed.shape == x.shape
    s64 = f64(s)
    ideal = f64(weight) * s64 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + eps)
    bound = np.abs(ideal) * (2 * unit(dtype) + (hidden + 4) * 2.0**-24) + TINY
    np.testing.assert_array_less(np.abs(f64(normed) - ideal), bound)


def test_add_rms_norm_keeps_a_nan_to_its_row_and_the_model_takes_it_on_cpu():
    x = np.ones((3, 40), np.float32)
    x[1, 7] = np.nan
    weight = jnp.full((40,), 2.0, jnp.bfloat16)
    s, normed = cpu_ops.add_rms_norm(jnp.asarray(x, jnp.bfloat16), None, weight, 1e-6)
    normed = f64(normed)
    assert np.isnan(normed[1]).all()
    np.testing.assert_array_equal(normed[[0, 2]], 2.0)  # ones over rms 1, times 2: exact
    # the model's glue lowers to the kernel on CPU (and to the jnp path elsewhere)
    text = jax.jit(functools.partial(layers.add_rms_norm, eps=1e-6)).lower(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(x), weight).as_text()
    assert cpu_library.TARGET_ADD_RMS_NORM in text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inner", [(1, 1536), (8, 1536), (3, 21), (40, 1536)])
@pytest.mark.parametrize("f32_input", [True, False])
def test_silu_mul_within_the_bound(dtype, rows, inner, f32_input):
    rng = np.random.default_rng(rows * 10 + inner)
    gate_up = rng.standard_normal((rows, 2 * inner)) * 4
    gate_up[0, :4] = [0.0, -0.0, 30.0, -30.0]  # sigmoid saturating both ways
    gate_up = jnp.asarray(gate_up, jnp.float32 if f32_input else dtype)
    out = jax.jit(cpu_ops.silu_mul, static_argnums=1)(gate_up, dtype)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (rows, inner)
    g = rounded(f64(gate_up[:, :inner]), dtype)
    u = rounded(f64(gate_up[:, inner:]), dtype)
    ideal = g / (1.0 + np.exp(-g)) * u
    bound = np.abs(ideal) * (2 * unit(dtype) + 6 * 2.0**-24) + TINY
    np.testing.assert_array_less(np.abs(f64(out) - ideal), bound)


def test_silu_mul_propagates_nan():
    gate_up = jnp.asarray([[np.nan, 1.0, 2.0, np.nan]], jnp.float32)
    out = f64(cpu_ops.silu_mul(gate_up, jnp.bfloat16))
    assert np.isnan(out).all()  # nan gate; nan up


# (heads, kv_heads, head_dim): SmolLM2's GQA, multi-head, Llama's head_dim 128, a small one
ROPE_SHAPES = [(9, 3, 64), (4, 4, 16), (8, 2, 128), (2, 1, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", ROPE_SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_qkv_rope_is_the_jnp_path_bit_for_bit(dtype, heads, kv_heads, dim, rows):
    rng = np.random.default_rng(heads * 1000 + dim + rows)
    qkv = jnp.asarray(rng.standard_normal((rows, (heads + 2 * kv_heads) * dim)) * 2, jnp.float32)
    positions = jnp.asarray(rng.integers(0, 4096, rows), jnp.int32)
    inv_freq = 10000.0 ** (-np.arange(0, dim, 2) / dim)
    angles = np.asarray(positions)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)
    for given in (qkv, qkv.astype(dtype)):  # the matmul's float32, or already rounded
        got = jax.jit(cpu_ops.qkv_rope, static_argnums=(3, 4))(given, cos, sin, heads,
                                                                     kv_heads)
        q = given.astype(dtype)[:, : heads * dim].reshape(rows, heads, dim)
        k = given.astype(dtype)[:, heads * dim : (heads + kv_heads) * dim]
        v = given.astype(dtype)[:, (heads + kv_heads) * dim :]
        want = (layers.rotate(q, cos, sin),
                layers.rotate(k.reshape(rows, kv_heads, dim), cos, sin),
                v.reshape(rows, kv_heads, dim))
        for name, a, b in zip("qkv", got, want, strict=True):
            assert same_bits(a, b), name
    # and the model's glue takes the kernel on CPU
    text = jax.jit(functools.partial(layers.split_rotate, num_heads=heads,
                                     num_kv_heads=kv_heads)).lower(qkv, cos, sin).as_text()
    assert cpu_library.TARGET_QKV_ROPE in text


@pytest.mark.parametrize("call,message", [
    (lambda: cpu_ops.add_rms_norm(jnp.ones((2, 8)), jnp.ones((2, 7)), jnp.ones(8), 1e-6),
     "add_rms_norm: x \\[T, H\\] \\[2, 8\\], delta"),
    (lambda: cpu_ops.add_rms_norm(jnp.ones((2, 8)), None, jnp.ones(8), -1.0),
     "eps must be >= 0"),
    (lambda: cpu_ops.add_rms_norm(jnp.ones((2, 8), jnp.float16), None,
                                        jnp.ones(8, jnp.float16), 1e-6),
     "runs float32 or bfloat16 models, got float16"),
    (lambda: cpu_ops.silu_mul(jnp.ones((2, 7)), jnp.float32), "silu_mul: gate_up"),
    (lambda: cpu_ops.qkv_rope(jnp.ones((2, 61)), jnp.ones((2, 4)), jnp.ones((2, 4)), 9, 3),
     "qkv_rope: qkv \\[T, \\(H \\+ 2 KH\\) D\\] \\[2, 61\\]"),
])
def test_bad_shapes_and_dtypes_are_clear_errors(call, message):
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(call())
