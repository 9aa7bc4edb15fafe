"""Gathers and scatters that move narrow floats as raw bits.

XLA:CPU has no bfloat16 / float16 / float8 scatter or gather of its own: its float
normalization rewrites one into float32 by converting the *whole operand*, so writing 16
tokens into a 1 GiB bfloat16 KV pool converted the pool to float32 and back on every step
(17M page faults and ~1 s of system time per step of a 135M model), and looking up 16 rows of
a bfloat16 embedding table converted all 49,152 rows. Moving the same bytes as unsigned
integers of the same width is exact (a gather or a replacing scatter never does arithmetic)
and lowered natively everywhere; a gather fuses its bitcast, so `take` is free. A scatter
cannot: XLA:CPU materializes the bitcast of its whole operand (two copies of the pool), so on
CPU `set_rows` writes narrow floats in place through the kernel library's `set_rows` custom
call (cpu/cache.h; as bits where the library is unavailable), and on accelerators, whose
scatters take narrow floats, as a plain scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ops, lowering, quantized

_BITS = {1: jnp.uint8, 2: jnp.uint16}


def _bits_dtype(dtype) -> jnp.dtype | None:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _BITS:
        return jnp.dtype(_BITS[dtype.itemsize])
    return None


def take(array: jax.Array, index) -> jax.Array:
    """``array[index]`` (numpy indexing), moved as bits for narrow floats."""
    bits = _bits_dtype(array.dtype)
    if bits is None:
        return array[index]
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(array, bits)[index], array.dtype)


def take_pool(pool, index) -> jax.Array:
    """`pool[index]` (numpy indexing of the leading [K, N, ...] axes) as kernels read it:
    a QuantizedPool's values and scales gathered and dequantized to float32, a float pool as
    it is; narrow floats gathered as bits (`take`)."""
    if quantized.is_quantized(pool):
        return quantized.dequantize(take(pool.values, index), take(pool.scales, index))
    return take(pool, index)


def set_rows(pool: jax.Array, index: jax.Array, values, *, token_major: bool = False
             ) -> jax.Array:
    """``pool.at[:, index].set(values)`` with the pool [K, ...] read as [K, N, *row]:
    values [K, T, *row] (cast to the pool's dtype; [T, K, *row] with `token_major`, which the
    CPU kernel reads as they lie and other platforms transpose), index [T] int32 within
    [0, N) (every entry: padding points at a real row, e.g. the reserved block 0). A [K,
    blocks, block_size, D] pool takes slot indices and [K, T, D] values as it is; pass it
    unreshaped (XLA:CPU copies a reshaped operand of the in-place call)."""
    values = jnp.asarray(values).astype(pool.dtype)
    index = jnp.asarray(index, jnp.int32)

    def scatter(p, i, v, as_bits=False):
        if token_major:
            v = v.swapaxes(0, 1)
        rows = p.reshape(p.shape[0], -1, *v.shape[2:])
        if as_bits:
            return _set_as_bits(rows, (slice(None), i), v).reshape(p.shape)
        return rows.at[:, i].set(v).reshape(p.shape)

    if _bits_dtype(pool.dtype) is None:
        return scatter(pool, index, values)
    # only XLA:CPU lacks narrow-float scatters; accelerators scatter them as they are
    cpu = (functools.partial(cpu_ops.set_rows, token_major=token_major)
           if cpu_ops.available() else lambda p, i, v: scatter(p, i, v, as_bits=True))
    return lowering.choose(pool, index, values, cpu=cpu, default=scatter)


def _set_as_bits(array: jax.Array, index, values: jax.Array) -> jax.Array:
    """``array.at[index].set(values)`` with both moved as same-width unsigned ints."""
    bits = _bits_dtype(array.dtype)
    out = jax.lax.bitcast_convert_type(array, bits).at[index].set(
        jax.lax.bitcast_convert_type(values, bits))
    return jax.lax.bitcast_convert_type(out, array.dtype)
