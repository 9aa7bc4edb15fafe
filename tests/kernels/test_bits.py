"""pallas_kernels/bits.py: gathers and pool writes of narrow floats, checked against NumPy,
eagerly (the custom call copies the pool first) and donated under jit (in place), and the
compiled KV write of a bfloat16 pool held free of the float32 round trip of the whole pool
that made bfloat16 ten times slower than float32 on CPU."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import bits, cpu_ops
from pallas_kernels.blockwise import write_kv

pytestmark = pytest.mark.kernels

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"]


def random_values(rng, shape, dtype):
    if dtype == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    return rng.standard_normal(shape).astype(np.float32).astype(getattr(ml_dtypes, dtype, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("token_major", [False, True])
def test_set_rows_writes_slots_and_blocks_as_numpy_does(dtype, donate, token_major):
    rng = np.random.default_rng(0)
    pool = random_values(rng, (3, 5, 4, 8), dtype)  # [K, blocks, block_size, D]
    set_rows = functools.partial(bits.set_rows, token_major=token_major)
    fn = jax.jit(set_rows, donate_argnums=0) if donate else set_rows
    # a KV write: slots of [K, blocks * block_size] rows of D, the pool passed unreshaped;
    # token-major values [T, K, D] as a step's projection leaves them
    slots = np.array([7, 0, 19, 4], np.int32)
    rows = random_values(rng, (3, 4, 8), dtype)
    expected = pool.reshape(3, 20, 8).copy()
    expected[:, slots] = rows
    given = rows.transpose(1, 0, 2).copy() if token_major else rows
    out = fn(jnp.asarray(pool), jnp.asarray(slots), jnp.asarray(given))
    assert out.dtype == pool.dtype and out.shape == pool.shape
    np.testing.assert_array_equal(np.asarray(out).reshape(3, 20, 8).view(np.uint8),
                                  expected.view(np.uint8))
    # a block copy: whole [block_size, D] rows by block id
    blocks = np.array([4, 1], np.int32)
    tiles = random_values(rng, (3, 2, 4, 8), dtype)
    expected = np.asarray(out).copy()
    expected[:, blocks] = tiles
    given = tiles.transpose(1, 0, 2, 3).copy() if token_major else tiles
    out = fn(out, jnp.asarray(blocks), jnp.asarray(given))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_take_gathers_as_numpy_does(dtype):
    rng = np.random.default_rng(1)
    table = random_values(rng, (50, 6), dtype)
    ids = np.array([3, 49, 0, 3], np.int32)
    out = jax.jit(bits.take)(jnp.asarray(table), jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), table[ids].view(np.uint8))


def test_an_index_outside_the_pool_is_an_error():
    if not cpu_ops.available():
        pytest.skip("the custom call needs the CPU kernel library")
    pool = jnp.zeros((2, 4, 4, 8), jnp.bfloat16)
    with pytest.raises(Exception, match="set_rows: index outside the pool"):
        jax.block_until_ready(bits.set_rows(pool, jnp.array([16], jnp.int32),
                                            jnp.ones((2, 1, 8), jnp.bfloat16)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_compiled_kv_write_never_converts_the_pool(dtype):
    """The optimized module of a donated KV write into a narrow-float pool holds no float32
    array of the pool's size and no copy of the pool: before bits.py XLA:CPU converted the
    whole pool to float32 and back around every scatter. Nor a transposed copy of the new
    K/V: the kernel reads them token-major, as the projection leaves them."""
    if not cpu_ops.available():
        pytest.skip("the in-place write needs the CPU kernel library")
    shape = (3, 64, 16, 64)
    pool = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    new = jax.ShapeDtypeStruct((8, 3, 64), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((8,), jnp.int32)
    write = jax.jit(functools.partial(write_kv), donate_argnums=(0, 1))
    text = write.lower(pool, pool, new, new, slots).compile().as_text()
    pool_elems = np.prod(shape)
    for dt, dims in re.findall(r"\b(f32|bf16|u16|u8|f8e4m3fn)\[([0-9,]+)\]", text):
        elems = np.prod([int(d) for d in dims.split(",")])
        assert not (dt == "f32" and elems >= pool_elems), f"float32 copy of the pool: {dims}"
    for op in ("copy", "fusion"):  # a pool-shaped copy or loop fusion rewrites the whole pool
        assert not re.search(rf"= \S+\[(3,64,16,64|3,1024,64)\]\S* {op}\(", text), op
    assert "jaxpage_set_rows" in text
    if jnp.dtype(dtype) == jnp.bfloat16:  # float8 pools convert the values, transposed or not
        assert not re.search(r"\[3,8,64\]", text), "the new K/V transposed before the write"
        assert re.search(r"custom-call\(\S+, \S+, %?k\S*\)", text), "k not passed as it is"


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e5m2"])
def test_the_fallback_without_the_library_writes_as_numpy_does(dtype):
    """Without the kernel library (no compiler) set_rows scatters the bits as uint16 / uint8:
    slower (XLA copies the pool), exact. Here called directly, NaN among the values."""
    rng = np.random.default_rng(2)
    rows = random_values(rng, (2, 6, 4), dtype)
    values = random_values(rng, (2, 2, 4), dtype)
    values[0, 1, 2] = np.nan
    index = np.array([5, 1], np.int32)
    expected = rows.copy()
    expected[:, index] = values
    out = jax.jit(lambda r, i, v: bits._set_as_bits(r, (slice(None), i), v))(
        jnp.asarray(rows), jnp.asarray(index), jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expected.view(np.uint8))
