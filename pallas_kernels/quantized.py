"""Quantized KV pools: int8 / float8 values with one float32 scale per (KV head, slot).

A quantized layer pool is a `QuantizedPool(values, scales)` where a float pool would be an
array: `values` [num_kv_heads, num_blocks, block_size, head_dim] in the storage dtype and
`scales` [num_kv_heads, num_blocks, block_size] float32. Position p of head h holds
`dequantize(values[h, p], scales[h, p]) = float32(values[h, p]) * scales[h, p]`.

Granularity, per (KV head, token): the scale is the row's absolute maximum over the format's
largest finite value, computed when the token is written (no calibration pass, nothing to
re-quantize when a block fills later: a per-block or per-head scale would change as tokens
arrive, and a per-tensor one needs calibration data the engine does not have). int8 needs a
fine scale to keep 8 bits of precision per row; the float8 formats need it for range only
(e4m3fn overflows past 448, and K of some models reaches hundreds), and get it from the same
rule so that every backend dequantizes one way. The scale costs 4 bytes per head and token
(head_dim 64: 68 bytes a row instead of 64, 3.76x the tokens of float32 per byte rather
than 4x; head_dim 128: 3.88x).

Rounding: int8 `round_half_even(x / s)` clipped to [-127, 127]; float8 `float8(x / s)`
(round to nearest even, as `astype` does); s = absmax * float32(1 / max_finite), or 1 for an
all-zero row.
Unowned slots may hold anything: a NaN scale (the tests' poisoning) makes the whole row NaN
whatever the format, so kernels must mask by position, never by value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# storage dtype name -> largest finite value (the scale maps a row's absmax onto it)
FORMATS = {
    "int8": 127.0,
    "float8_e4m3fn": float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    "float8_e5m2": float(jnp.finfo(jnp.float8_e5m2).max),  # 57344
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPool:
    """One quantized K or V pool of a layer (a pytree of its two arrays)."""

    values: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim], int8 / float8
    scales: jax.Array  # [num_kv_heads, num_blocks, block_size] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> jnp.dtype:
        """The storage dtype of the values."""
        return jnp.dtype(self.values.dtype)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


def is_quantized(pool) -> bool:
    return isinstance(pool, QuantizedPool)


def is_format(dtype) -> bool:
    """Whether `dtype` is a quantized KV format (one of FORMATS)."""
    return jnp.dtype(dtype).name in FORMATS


def format_max(dtype) -> float:
    name = jnp.dtype(dtype).name
    if name not in FORMATS:
        raise ValueError(f"not a quantized KV format: {name}; choose from {tuple(FORMATS)}")
    return FORMATS[name]


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (values [..., head_dim] in dtype, scales [...] float32)."""
    fmax = format_max(dtype)
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    # times float32(1 / max), not / max: XLA rewrites a division by a constant into that
    # product, so writing it out keeps one rounding everywhere
    scales = jnp.where(absmax > 0, absmax * np.float32(1 / fmax), 1.0).astype(jnp.float32)
    y = x / scales[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        values = jnp.clip(jnp.round(y), -fmax, fmax).astype(jnp.int8)
    else:  # |y| <= fmax by construction (the clip guards only rounding at the top)
        values = jnp.clip(y, -fmax, fmax).astype(dtype)
    return values, scales


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """float32(values) * scales[..., None]: the one dequantization every backend performs."""
    return values.astype(jnp.float32) * scales[..., None]


def dequantize_pool(pool) -> jax.Array:
    """A float32 pool equal to what a kernel reads from `pool` (a float pool as it is)."""
    if is_quantized(pool):
        return dequantize(pool.values, pool.scales)
    return pool


def empty_pool(shape: tuple[int, ...], dtype, *, scale_fill: float = 1.0,
               device=None) -> QuantizedPool:
    """A quantized pool of [K, N, block_size, D]: zero values, scales `scale_fill` (NaN makes
    every slot read NaN whatever the format)."""
    values = jnp.zeros(shape, dtype, device=device)
    scales = jnp.full(shape[:-1], scale_fill, jnp.float32, device=device)
    return QuantizedPool(values, scales)


def quantize_pool(pool: jax.Array, dtype) -> QuantizedPool:
    """A float pool quantized row by row (tests and benchmarks build pools this way)."""
    return QuantizedPool(*quantize(pool, dtype))
