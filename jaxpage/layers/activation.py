"""The gated MLP's activations."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpage.layers import dispatch
from pallas_kernels import cpu_ops

# the gated MLP's activation by HF name (ModelConfig.hidden_act); gelu_pytorch_tanh is
# torch's gelu(approximate="tanh")
ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def silu_mul(gate_up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up in `dtype` for gate_up [T, 2I] = [gate | up] (float32 before rounding,
    or `dtype`), as the MLP computes them. On CPU one kernel call (`cpu_ops.silu_mul`:
    silu in float32 rounded once, as HF's bfloat16 silu; XLA rounds each of its ops)."""
    def default(gate_up):
        gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
        return jax.nn.silu(gate) * up

    if gate_up.ndim != 2 or not dispatch.glue_dtype(dtype):
        return default(gate_up)
    return dispatch.cpu_glue(functools.partial(cpu_ops.silu_mul, dtype=dtype), default, gate_up)
