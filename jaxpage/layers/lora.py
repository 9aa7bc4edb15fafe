"""The LoRA deltas of a step whose tokens run under several adapters (jaxpage.lora)."""

from __future__ import annotations

import jax

from pallas_kernels import lora as lora_kernels


def lora_matmul(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                live_rows: jax.Array | None = None) -> jax.Array:
    """y [T, N] float32 (a projection's output of x [T, K]) plus, for each token t,
    `round(x[t] @ a[slots[t]]) @ b[slots[t]]` (a [S, K, R], b [S, R, N]; slot 0 holds zeros:
    no adapter): on CPU the kernel library's grouped kernel, which reads each slot's
    weights once for all of its tokens; elsewhere jnp's per-token gather
    (`pallas_kernels.lora`)."""
    return lora_kernels.lora_matmul(y, x, a, b, slots, live_rows=live_rows)
