"""The params as a runner places them: cast to the engine's dtype (8-bit weights kept as loaded)
and, on a CPU whose kernel library serves them, packed for its matmul."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.layers import quantized_linear
from pallas_kernels import cpu_ops


def packs_weights(model: Any, device: Any, dtype) -> bool:
    """Whether a one-device runner keeps the model's weights packed for the CPU kernel's packed
    matmul (`jaxpage.models.llama.pack_params`): float32 or bfloat16 on a CPU device where the
    kernel library is available, for a model that offers `pack_params`;
    `JAXPAGE_CPU_PACKED_WEIGHTS=0` turns it off (the [K, N] layout, for comparisons)."""
    return (device.platform == "cpu" and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
            and hasattr(model, "pack_params")
            and os.environ.get("JAXPAGE_CPU_PACKED_WEIGHTS", "1") != "0"
            and cpu_ops.available())


def pack_params(model: Any, params: Any) -> Any:
    """The model's params packed for the kernel (`packs_weights` said so), their layers stacked
    (one array a param name, `jaxpage.layers.stacked`: a step's call hands the host a few
    arrays to dispatch, not hundreds) where the model reads them so (`reads_stacked_layers`)
    and `JAXPAGE_CPU_STACKED_LAYERS` is not "0" (per-layer arrays, for comparisons)."""
    if (getattr(model, "reads_stacked_layers", False)
            and os.environ.get("JAXPAGE_CPU_STACKED_LAYERS", "1") != "0"):
        return model.pack_params(params, stack=True)
    return model.pack_params(params)


def cast_params(params: Any, dtype) -> Any:
    """`cast_float` over a params pytree; an 8-bit weight (values and float32 scales) is kept
    as loaded."""
    return jax.tree.map(lambda a: a if quantized_linear.is_quantized(a) else cast_float(a, dtype),
                        params, is_leaf=quantized_linear.is_quantized)


def cast_float(leaf: Any, dtype) -> Any:
    """Cast floating-point params to the engine dtype (no copy when the loader already made
    them that dtype); leave integer buffers and keys alone."""
    array = np.asarray(leaf) if not hasattr(leaf, "dtype") else leaf
    if jnp.issubdtype(array.dtype, jnp.floating):
        return np.asarray(array).astype(dtype, copy=False)
    return array
