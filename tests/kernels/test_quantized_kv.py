"""Quantized KV pools (pallas_kernels/quantized.py): the quantization rule, hand-worked; the
write; and every backend reading a quantized pool exactly as it reads the float32 pool the
quantized one dequantizes to (the same arithmetic after one elementwise dequantization), with
NaN scales in unowned slots, and within float32 rounding of a float64 oracle on those
dequantized values."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_reference import naive_attention, random_batch

from pallas_kernels import quantized
from pallas_kernels.blockwise import paged_attention_blockwise, write_kv
from pallas_kernels.reference import paged_attention_reference

pytestmark = pytest.mark.kernels

FORMATS = list(quantized.FORMATS)


def one_format_each(cases, formats=FORMATS) -> list:
    """pytest params (*case, fmt) of every case with every format; in the default suite each
    case runs one format (taking turns, so every format is covered), the rest are slow."""
    return [pytest.param(*case, fmt, marks=() if j == i % len(formats) else pytest.mark.slow)
            for i, case in enumerate(cases) for j, fmt in enumerate(formats)]


def owned_mask(tables, seq_lens, num_blocks, block_size):
    owned = np.zeros((num_blocks, block_size), bool)
    for table, length in zip(tables, seq_lens, strict=True):
        pos = np.arange(length)
        owned[table[pos // block_size], pos % block_size] = True
    return owned


def quantized_batch(rng, fmt, **kwargs):
    """`random_batch` with its pools quantized to `fmt` and NaN scales in every unowned slot.

    Returns (args with QuantizedPools, args with the float32 pools they dequantize to, keys
    and values per sequence as dequantized: the oracle's inputs)."""
    args, _, _ = random_batch(rng, **kwargs)
    q, k_pool, v_pool, tables, seq_lens, qsl = args
    owned = owned_mask(tables, seq_lens, k_pool.shape[1], k_pool.shape[2])
    pools = []
    for pool in (k_pool, v_pool):
        qp = quantized.quantize_pool(jnp.asarray(np.nan_to_num(pool)), jnp.dtype(fmt))
        scales = np.array(qp.scales)
        scales[:, ~owned] = np.nan
        pools.append(quantized.QuantizedPool(qp.values, jnp.asarray(scales)))
    deq = [np.asarray(quantized.dequantize_pool(p)) for p in pools]
    block_size = k_pool.shape[2]
    keys, values = [], []
    for table, length in zip(tables, seq_lens, strict=True):
        pos = np.arange(length)
        blocks, offsets = table[pos // block_size], pos % block_size
        keys.append(deq[0][:, blocks, offsets].transpose(1, 0, 2))  # [L, K, D]
        values.append(deq[1][:, blocks, offsets].transpose(1, 0, 2))
    return ((q, *pools, tables, seq_lens, qsl), (q, *deq, tables, seq_lens, qsl), keys, values)


def assert_exact_and_near_oracle(out_q, out_f, args, keys, values, scale):
    out_q, out_f = np.asarray(out_q), np.asarray(out_f)
    assert np.isfinite(out_q).all(), "an unowned slot (NaN scale) leaked into the output"
    np.testing.assert_array_equal(out_q, out_f)
    q, qsl = args[0], args[5]
    for s in range(len(keys)):
        rows = slice(qsl[s], qsl[s + 1])
        expected = naive_attention(q[rows].astype(np.float64), keys[s].astype(np.float64),
                                   values[s].astype(np.float64), scale)
        np.testing.assert_allclose(out_q[rows], expected, atol=2e-5, rtol=0, err_msg=f"seq {s}")


def test_int8_quantization_hand_worked():
    # absmax 2 -> scale 2 * float32(1/127); x / s = 63.5, -127, 15.875, 0, which round half
    # to even to 64, -127, 16, 0
    x = jnp.array([[1.0, -2.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    values, scales = quantized.quantize(x, jnp.int8)
    assert values.dtype == jnp.int8 and scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(values), [[64, -127, 16, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(scales), [2 * np.float32(1 / 127), 1.0])
    np.testing.assert_array_equal(np.asarray(quantized.dequantize(values, scales))[1], 0)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_quantization_matches_ml_dtypes(fmt):
    """The row's absmax maps onto the format's largest finite value; every element rounds to
    nearest even in ml_dtypes' (NumPy's) conversion of the float32 quotient."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 32)) * rng.uniform(1e-3, 1e3, (64, 1))).astype(np.float32)
    values, scales = quantized.quantize(jnp.asarray(x), jnp.dtype(fmt))
    fmax = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)
    expected_scales = np.abs(x).max(-1) * np.float32(1 / fmax)
    np.testing.assert_array_equal(np.asarray(scales), expected_scales)
    expected = (x / expected_scales[:, None]).astype(getattr(ml_dtypes, fmt))
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), expected.view(np.uint8))
    # every row's largest element is the format's largest value, exactly
    np.testing.assert_array_equal(np.abs(np.asarray(values).astype(np.float32)).max(-1), fmax)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_quantizes_each_row_at_its_slot(fmt):
    rng = np.random.default_rng(1)
    k_pool = quantized.empty_pool((2, 4, 4, 8), jnp.dtype(fmt))
    v_pool = quantized.empty_pool((2, 4, 4, 8), jnp.dtype(fmt))
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    v = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([5, 14, 0], np.int32)  # block 1 offset 1, block 3 offset 2, block 0
    k_out, v_out = write_kv(k_pool, v_pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    for new, pool in ((k, k_out), (v, v_out)):
        assert isinstance(pool, quantized.QuantizedPool) and pool.dtype == jnp.dtype(fmt)
        values = np.asarray(pool.values).reshape(2, 16, 8)
        scales = np.asarray(pool.scales).reshape(2, 16)
        want_v, want_s = quantized.quantize(jnp.asarray(new.transpose(1, 0, 2)), jnp.dtype(fmt))
        np.testing.assert_array_equal(values[:, slots].astype(np.float32),
                                      np.asarray(want_v).astype(np.float32))
        np.testing.assert_array_equal(scales[:, slots], np.asarray(want_s))
        untouched = np.setdiff1d(np.arange(16), slots)
        assert not values[:, untouched].astype(np.float32).any()
        np.testing.assert_array_equal(scales[:, untouched], 1.0)


# (num_heads, num_kv_heads, block_size); seeds 1 and 2 run in the slow suite
POOL_SHAPES = [(4, 4, 4), (6, 2, 16), (9, 3, 1)]


@pytest.mark.parametrize("seed,num_heads,num_kv_heads,block_size,fmt", [
    *one_format_each([(0, *shape) for shape in POOL_SHAPES]),
    *(pytest.param(seed, *shape, fmt, marks=pytest.mark.slow)
      for seed in (1, 2) for shape in POOL_SHAPES for fmt in FORMATS)])
def test_jnp_backends_read_quantized_pools_as_their_dequantization(seed, num_heads,
                                                                   num_kv_heads, block_size, fmt):
    rng = np.random.default_rng(seed)
    args_q, args_f, keys, values = quantized_batch(
        rng, fmt, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8,
        block_size=block_size)
    max_query_len = int(np.diff(args_q[5]).max())
    for attend in (paged_attention_reference, paged_attention_blockwise):
        out_q = attend(*args_q, max_query_len=max_query_len)
        out_f = attend(*args_f, max_query_len=max_query_len)
        assert_exact_and_near_oracle(out_q, out_f, args_q, keys, values, 8**-0.5)

