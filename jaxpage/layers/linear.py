"""Matmuls of activations by weights, and the weight layout each backend streams fastest.

`matmul_f32` picks the implementation: an 8-bit weight (`quantized_linear.QuantizedWeight`)
goes through `quantized_linear.matmul_f32`; a packed weight (`pack_weight`, CPU only)
through the kernel library's packed matmul; on CPU, few rows of float32/bfloat16 through its
small_matmul where it is built for AVX-512; everywhere else XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.layers import quantized_linear, stacked
from pallas_kernels import cpu_ops, lowering

# rows up to which a CPU matmul takes the kernel library's small_matmul (decode steps and
# short chunks), by dtype and weight layout ([K, N]: the projections; [N, K]: a tied LM head):
# where it beat XLA:CPU's dot in every run on SmolLM2's shapes (scripts/bench_small_matmul.py
# --vs-xla; docs/bench/cpu_small_matmul_vs_xla_2026-12-01.log). bfloat16, a step's 121
# matmuls: 8 rows 1.85x, 32 rows 1.14x, 48 rows 0.9-1.1x across runs (the projections 0.9x in
# that log); the head alone 16 rows 1.02-1.17x, 24 rows 0.93-1.03x. float32 projections 32
# rows 53.9 vs 57.5 ms, 48 rows 74.4 vs 69.8; float32 head 16 rows 9.2 vs 10.8, 24 rows 14.8
# vs 14.4.
SMALL_MATMUL_ROWS = {("bfloat16", False): 32, ("bfloat16", True): 16,
                     ("float32", False): 32, ("float32", True): 16}


def packable(w) -> bool:
    """Whether the CPU kernel's packed matmul takes weight w [K, N] (`cpu_ops.packable`:
    float32 or bfloat16, N a multiple of the build's panel width: 32 columns with AVX-512,
    else 16)."""
    return cpu_ops.packable(w)


def pack_weight(w):
    """w [K, N] packed into the panels `cpu_ops.packed_matmul` streams in order
    (`cpu_ops.pack_weight`; NumPy weights pack on the host): every matmul of it, decode and
    prefill alike, reads its weights sequentially (a 1-8 row step ~25% faster than on the
    [K, N] walk, and from 64 to 256 rows 1.1-2x XLA's dot, 0.94x bfloat16 / 1.04x float32 at
    1024). `matmul_f32` and `linear` take packed weights as they take the others."""
    return cpu_ops.pack_weight(w)


def linear(x: jax.Array, w: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
    """x @ w accumulated in float32 and rounded once to x's dtype (as PyTorch's bfloat16
    matmuls do). For bfloat16 this is also XLA:CPU's fast path: a bfloat16 dot with a
    bfloat16 result runs ~4x slower there than one with a float32 result (SmolLM2's [16, 576]
    x [576, 1536] projection: 1.10 ms vs 0.28 ms; float32 inputs: 0.21 ms). `live_rows`: x's
    rows past it are a shape bucket's padding, whose products a packed weight leaves as zeros
    (see `matmul_f32`)."""
    return matmul_f32(x, w, live_rows=live_rows).astype(x.dtype)


def matmul_f32(x: jax.Array, w: jax.Array, *, transpose_w: bool = False,
               live_rows: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ w ([K, N], or [N, K] with `transpose_w`) -> float32 [M, N]. A packed weight
    (`pack_weight`: 4-D, only ever on CPU) goes through `cpu_ops.packed_matmul`, any M.
    Otherwise, on CPU, for float32/bfloat16 operands of one dtype and M up to its
    SMALL_MATMUL_ROWS, through `cpu_ops.small_matmul` where the kernel library is built
    for AVX-512 (XLA:CPU's matmuls stream the weights at about half the read bandwidth with so
    few rows; without AVX-512 the walks lose to XLA: `cpu_ops.wide_vectors`); elsewhere,
    and on every other platform, jnp's dot. Only the packed path reads `live_rows` (x's rows
    past it are padding): it multiplies only the live rows, the others are zeros there and
    whatever the dot gives elsewhere; no one reads them. An 8-bit weight
    (`quantized_linear.QuantizedWeight`, never transposed) takes `quantized_linear.matmul_f32`:
    the CPU kernel's int8 packed matmul where packed, else XLA's dot. A layer of a stack
    (`stacked.LayerWeight`, packed) takes the kernel's matmul reading it in place."""
    if stacked.is_layer_weight(w):
        return stacked.matmul_f32(x, w, live_rows=live_rows)
    if quantized_linear.is_quantized(w):
        return quantized_linear.matmul_f32(x, w, live_rows=live_rows)
    if w.ndim == 4:
        return cpu_ops.packed_matmul(x, w, live_rows=live_rows)

    def dot(x, w):
        if transpose_w:
            return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    dtype = jnp.dtype(x.dtype)
    if (x.ndim != 2 or w.ndim != 2 or dtype != jnp.dtype(w.dtype)
            or x.shape[0] > SMALL_MATMUL_ROWS.get((dtype.name, transpose_w), 0)
            or not cpu_ops.wide_vectors()):  # built, and for AVX-512
        return dot(x, w)

    def kernel(x, w):
        return cpu_ops.small_matmul(x, w, transpose_w=transpose_w)

    # only XLA:CPU takes the kernel; accelerators lower the dot as before
    return lowering.choose(x, w, cpu=kernel, default=dot)
