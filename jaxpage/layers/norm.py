"""RMSNorm, alone and fused with the residual add before it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpage.layers import dispatch
from pallas_kernels import cpu_ops


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False
             ) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back (as HF does).

    With `unit_offset` (Gemma) the scale is 1 + weight, and HF applies it in float32
    before the cast rather than after it (Llama casts, then multiplies by the weight).
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float
                 ) -> tuple[jax.Array, jax.Array]:
    """(s, rms_norm(s, weight, eps)) with s = x + delta.astype(x.dtype) (x without delta): a
    residual add (delta: a sublayer's output, float32 before rounding or x's dtype) and the
    norm after it, for x [T, H]. On CPU one kernel call (`cpu_ops.add_rms_norm`: the same
    sum bit for bit, the norm to float32 rounding of rms_norm's)."""
    def default(x, delta, weight):
        s = x if delta is None else x + delta.astype(x.dtype)
        return s, rms_norm(s, weight, eps)

    if x.ndim != 2 or not dispatch.glue_dtype(x.dtype) or weight.dtype != x.dtype:
        return default(x, delta, weight)
    return dispatch.cpu_glue(functools.partial(cpu_ops.add_rms_norm, eps=eps), default,
                             x, delta, weight)
