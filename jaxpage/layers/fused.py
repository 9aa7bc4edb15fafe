"""A whole decoder layer in one call of the CPU kernel library (`cpu_ops.decoder_layer`).

A plain Llama-family layer of a step of at most FUSED_LAYER_ROWS tokens runs its eleven calls
(matmuls, glue, pool writes, attention) as one: each of them would schedule its helper threads
and start its weight stream anew. In one call a decode step of SmolLM2 at context 128 ran 1.05x
/ 1.04x / 1.04x / 1.02x faster at 1 / 2 / 4 / 8 rows in bfloat16, 1.02-0.99x in float32
(scripts/lab/decode_step_ab.py --vs-unfused), and 1.05-1.08x at 16-64 rows in bfloat16; it is
bit for bit the unfused calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jaxpage.layers import dispatch, quantized_linear, stacked
from pallas_kernels import cpu_ops

if TYPE_CHECKING:
    from jaxpage.attention import AttentionMetadata, LayerKV

# the layer the kernel takes: the Llama-family params layout's norms and projections (no
# biases, no q/k norms), the projections packed (`linear.pack_weight`)
FUSED_LAYER_WEIGHTS = ("qkv", "o", "gate_up", "down")
FUSED_LAYER_PARAMS = frozenset(("attn_norm", "mlp_norm") + FUSED_LAYER_WEIGHTS)
# steps of at most this many tokens run such layers in one call each on CPU: a decode step's
# buckets up to 64 sequences. Fused against unfused, alternating in one process (2-core AMD
# EPYC, SmolLM2 at context 128): bfloat16 0.95x / 0.96x / 0.93x the time at 16 / 32 / 64 rows,
# float32 0.96x / 1.00x at 16 / 64, int8 weights 0.95x / 0.96x; the pure decode steps of at
# most 8 rows it was first measured for gained 2-5%.
FUSED_LAYER_ROWS = 64


def fusable(layer: dict, layer_kv: LayerKV, next_norm: jax.Array, x: jax.Array,
            metadata: AttentionMetadata, head_dim: int) -> bool:
    """Whether the kernel runs this layer (SiLU, one device: the caller's to check): a step of
    at most FUSED_LAYER_ROWS tokens on the C++ attention backend, a plain layer
    (FUSED_LAYER_PARAMS, its projections packed), float32 or bfloat16 throughout (pools
    included: not quantized, not padded past head_dim), the library built. A projection may
    instead be int8 packed for the kernel (`quantized_linear.QuantizedWeight` with `packed`),
    which the kernel scales per column as `packed_matmul_int8` does; fp8 and unpacked 8-bit
    weights run unfused."""
    dtype = x.dtype

    def packed(w) -> bool:  # a weight, or a layer of a stack (`stacked.LayerWeight`)
        whole = w.stacked if stacked.is_layer_weight(w) else w
        if quantized_linear.is_quantized(whole):
            return whole.packed and whole.format == "int8"
        return w.ndim == 4 and w.dtype == dtype

    return (metadata.backend == "cpp"
            and x.shape[0] <= FUSED_LAYER_ROWS and dispatch.glue_dtype(dtype)
            and set(layer) == FUSED_LAYER_PARAMS
            and all(packed(layer[name]) for name in FUSED_LAYER_WEIGHTS)
            and layer["mlp_norm"].dtype == dtype and next_norm.dtype == dtype
            and all(isinstance(pool, jax.Array) and pool.dtype == dtype
                    and pool.shape[-1] == head_dim for pool in layer_kv)
            and cpu_ops.available())


def decoder_layer(x: jax.Array, h: jax.Array, layer: dict, cos: jax.Array, sin: jax.Array,
                  layer_kv: LayerKV, metadata: AttentionMetadata, next_norm: jax.Array, *,
                  num_heads: int, eps: float, live_rows: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, LayerKV]:
    """(x2, h2, layer_kv2) of a `fusable` layer: x2 its output for the residual stream x
    [T, H] and x's attention norm h, h2 = rms_norm(x2) * next_norm (the next layer's input
    norm, or the final one), the pools with the step's K/V written (`cpu_ops.decoder_layer`:
    in place). The layer may be one of a stack (`stacked.StackedLayers.layer`: its params
    `LayerWeight`s) and `next_norm` too: the kernel reads them in place."""
    weights, index = {}, None
    for name, w in layer.items():
        if stacked.is_layer_weight(w):
            w, index = w.stacked, w.index
        if name in FUSED_LAYER_WEIGHTS and quantized_linear.is_quantized(w):
            # an int8 weight: its values, its scales beside
            weights[name], weights[f"{name}_scale"] = w.values, w.scale
        else:
            weights[name] = w
    next_index = None
    if stacked.is_layer_weight(next_norm):
        next_norm, next_index = next_norm.stacked, next_norm.index
    x, h, *pools = cpu_ops.decoder_layer(
        x, h, weights, cos, sin, *layer_kv, metadata.slot_mapping, metadata.block_tables,
        metadata.seq_lens, metadata.query_start_loc, next_norm, num_heads=num_heads, eps=eps,
        live_rows=live_rows, layer=index, next_layer=next_index)
    return x, h, tuple(pools)
