"""Where a layer's elementwise glue runs: one call into the CPU kernel library, or XLA's ops.

A layer's glue (a residual add and the norm after it, the MLP's activation, q/k's rotation)
is a few KB of elementwise work that XLA:CPU runs as several loop fusions, split over its
threads from 8 rows on, ~5-20 us each; the kernel library runs each as one call. The choice
is made at trace time where the library is built, and by `pallas_kernels.lowering.choose`
(at trace time where the caller names its platform, else at lowering): only XLA:CPU takes the
kernel, every other platform lowers the jnp form.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import cpu_ops, lowering


def cpu_glue(cpu, default, *args):
    """`default(*args)`, or `cpu(*args)` (a kernel library call) on CPU where the library is
    built."""
    if not cpu_ops.available():
        return default(*args)
    return lowering.choose(*args, cpu=cpu, default=default)


def glue_dtype(dtype) -> bool:
    """Whether the kernel library's glue and fused layer take this activation dtype."""
    return jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
