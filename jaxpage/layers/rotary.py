"""Rotary position embedding in the half-split ("rotate_half") convention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpage.layers import dispatch
from pallas_kernels import cpu_ops


def cos_sin(inv_freq, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [T, D] in `dtype` for positions [T], from a rope's inverse
    frequencies [D/2] (float32; `jaxpage.models.config.rope_inv_freq`)."""
    inv_freq = jnp.asarray(inv_freq)  # [D/2] float32
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding in the half-split ("rotate_half") convention.

    x: [T, heads, D]; cos, sin: [T, D] already in x's dtype.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def split_rotate(qkv: jax.Array, cos: jax.Array, sin: jax.Array, num_heads: int,
                 num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, heads, D], k and v [T, kv_heads, D] in cos's dtype from the fused projection's
    qkv [T, (heads + 2 kv_heads) D] (float32 before rounding, or that dtype), q and k rotated
    (`rotate`). On CPU one kernel call (`cpu_ops.qkv_rope`, bit for bit this)."""
    dim = cos.shape[-1]

    def default(qkv, cos, sin):
        qkv = qkv.astype(cos.dtype)
        q = qkv[:, : num_heads * dim].reshape(-1, num_heads, dim)
        k = qkv[:, num_heads * dim : (num_heads + num_kv_heads) * dim]
        v = qkv[:, (num_heads + num_kv_heads) * dim :]
        return (rotate(q, cos, sin), rotate(k.reshape(-1, num_kv_heads, dim), cos, sin),
                v.reshape(-1, num_kv_heads, dim))

    if (qkv.ndim != 2 or not dispatch.glue_dtype(cos.dtype) or sin.dtype != cos.dtype
            or dim % 2):
        return default(qkv, cos, sin)
    return dispatch.cpu_glue(functools.partial(cpu_ops.qkv_rope, num_heads=num_heads,
                                               num_kv_heads=num_kv_heads),
                             default, qkv, cos, sin)
