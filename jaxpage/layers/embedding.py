"""Token embedding: rows of the embedding table, plain, packed as a tied LM head, or split
over a tensor-parallel axis by vocabulary range."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.layers import quantized_linear
from pallas_kernels import bits


def embed(table: jax.Array, token_ids: jax.Array, hidden_size: int,
          tp_axis: str | None = None, dtype=None) -> jax.Array:
    """[T] ids -> [T, H] rows of `table`, gathered as bits (XLA:CPU would convert a bfloat16
    table whole to gather from it). A table [V, H]; or one packed as a tied head
    (`linear.pack_weight` of [H, V]: [V / P, ceil(H / G), P, G], P columns a panel), whose id
    v's row is panel v // P, column v % P; or with `tp_axis`, this device's vocabulary range
    [V / devices, H]: each device looks up the ids in its range and the partial rows are
    summed over the axis. A tied head quantized (`quantized_linear.quantize_head`: 8-bit
    values [H, V] or packed, a float32 scale [V]; with `tp_axis` this device's columns [H,
    V / devices] and their scales) gives values[:, v] * scale[v] in `dtype`."""
    if quantized_linear.is_quantized(table):
        values = table.values
        if table.packed:
            panel = values.shape[2]
            rows = values[token_ids // panel, :, token_ids % panel, :].reshape(
                token_ids.shape[0], -1)[:, :hidden_size]
            return (rows.astype(jnp.float32) * table.scale[token_ids][:, None]).astype(dtype)
        if tp_axis is None:
            return (jnp.take(values, token_ids, axis=1).T.astype(jnp.float32)
                    * table.scale[token_ids][:, None]).astype(dtype)
        columns = values.shape[1]
        local = token_ids - jax.lax.axis_index(tp_axis) * columns
        mine = (local >= 0) & (local < columns)
        local = jnp.clip(local, 0, columns - 1)
        rows = jnp.take(values, local, axis=1).T.astype(jnp.float32) * table.scale[local][:, None]
        # one device holds each row: the sum is that row, rounded to dtype as on one device
        return jax.lax.psum(jnp.where(mine[:, None], rows, 0), tp_axis).astype(dtype)
    if table.ndim == 4:
        panel = table.shape[2]  # the packing's panel width (the build's)
        # [T, ceil(H / G), G]
        rows = bits.take(table, (token_ids // panel, slice(None), token_ids % panel,
                                 slice(None)))
        return rows.reshape(token_ids.shape[0], -1)[:, :hidden_size]
    if tp_axis is None:
        return bits.take(table, token_ids)
    rows = table.shape[0]
    local = token_ids - jax.lax.axis_index(tp_axis) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], bits.take(table, jnp.clip(local, 0, rows - 1)), 0)
    return jax.lax.psum(x, tp_axis)
