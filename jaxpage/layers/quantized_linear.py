"""Weights kept in 8 bits with a float32 scale per output column, and their matmuls.

Weight-only quantization (W8A16): a decoder projection's weight w [K, N] is kept as
`QuantizedWeight(values, scale)`, values [K, N] int8 or float8_e4m3fn and scale [N] float32,
w[k, n] ~ values[k, n] * scale[n]; a MoE layer's experts [E, K, N] keep a scale per expert and
column, [E, N]. The activations stay in the engine's dtype: x @ w is (x @ values) * scale, the
values widened to x's dtype inside the matmul (exactly: every int8 and every float8_e4m3fn is a
bfloat16), the products accumulated in float32 and each column scaled once after. A matmul
reads half a bfloat16 weight's bytes (a quarter of a float32's), plus 4 bytes a column.

The rule (`quantize`, symmetric, per output column, as vLLM's and llm-compressor's channel
strategy): scale = max |w[:, n]| / M with M = 127 for int8 and 448 (float8_e4m3fn's largest
finite value) for fp8, values = round(w / scale), int8 clipped to [-127, 127], fp8 rounded to
the nearest float8_e4m3fn (ties to even). An element's error is at most scale / 2 for int8
(max |w[:, n]| / 254), and for fp8 half a float8 step at its magnitude: 2^-4 of it relative
(3 mantissa bits), at most 16 * scale / 2 in absolute terms.

How a matmul runs (`matmul_f32`): XLA's dot of x by the widened values with a float32 result,
times the scale: written so that an accelerator's compiler can feed the 8-bit values to the
matmul unit (the widening is an elementwise producer of the dot, which XLA's GPU and TPU
compilers fuse into it) and no full-width copy of the weight is kept. On CPU, an int8 weight
packed for the kernel library (`pack`, where `cpu_ops` offers `packed_matmul_int8` and is
built) goes through it: XLA:CPU would widen the whole weight into a temporary every step. That
kernel scales each row of x to int16 (2^-16 of the row's largest magnitude an element) and
multiplies in integers, exactly: what lets it keep up with the halved bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ops

# EngineConfig.quantization's values: the values' dtype and the magnitude a column's largest
# |w| maps to
QUANTIZATIONS = ("int8", "fp8")
VALUE_DTYPES = {"int8": np.dtype(jnp.int8), "fp8": np.dtype(jnp.float8_e4m3fn)}
FORMAT_MAX = {"int8": 127.0, "fp8": 448.0}


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight [..., K, N] as 8-bit `values` and a float32 `scale` [..., N] per output
    column (module doc). A pytree of its two arrays (`packed` is static): it moves, shards
    and traces as the arrays do. `packed`: `values` is the CPU kernel's packed int8 layout
    (`pack`), not [K, N]."""

    values: Any
    scale: Any
    packed: bool = False

    @property
    def format(self) -> str:
        """"int8" or "fp8"."""
        return "int8" if jnp.dtype(self.values.dtype) == jnp.int8 else "fp8"

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (of `values`, unpacked)."""
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scale.nbytes)

    def __getitem__(self, index) -> QuantizedWeight:
        """The weights at `index` of the leading axes, e.g. one expert's [K, N] or one layer's
        of a stack (`jaxpage.layers.stacked`), packed as the stack is."""
        return QuantizedWeight(self.values[index], self.scale[index], self.packed)


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["values", "scale"],
                                 meta_fields=["packed"])


def is_quantized(w: Any) -> bool:
    return isinstance(w, QuantizedWeight)


def quantize(w: Any, fmt: str) -> QuantizedWeight:
    """w [..., K, N] (NumPy, any float dtype) -> its QuantizedWeight in format `fmt` ("int8"
    or "fp8"; module doc), on the host: computed in float32, scale float32 [..., N]. A column
    of zeros gets scale 1 and zero values."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-2)
    scale = np.where(amax > 0, amax / np.float32(FORMAT_MAX[fmt]), np.float32(1))
    scaled = np.clip(w / scale[..., None, :], -FORMAT_MAX[fmt], FORMAT_MAX[fmt])
    if fmt == "int8":
        scaled = np.rint(scaled)
    return QuantizedWeight(np.ascontiguousarray(scaled.astype(VALUE_DTYPES[fmt])),
                           scale.astype(np.float32))


def dequantize(w: QuantizedWeight, dtype: Any = np.float32) -> Any:
    """values * scale as a `dtype` array [..., K, N] (NumPy in, NumPy out): the weight a
    QuantizedWeight stands for, for references and for a weight that must be full width."""
    xp = np if isinstance(w.values, np.ndarray) else jnp
    full = w.values.astype(xp.float32) * w.scale[..., None, :]
    return full.astype(dtype)


def map_columns(w: Any, fn) -> Any:
    """fn applied to a weight's output columns: to w, or to a QuantizedWeight's values and
    scale alike (both have the columns last), e.g. the tensor-parallel column interleaving."""
    if is_quantized(w):
        return QuantizedWeight(fn(w.values), fn(w.scale), w.packed)
    return fn(w)


def concat_columns(ws: list) -> Any:
    """Weights [K, N_i] side by side -> [K, sum N_i] (q/k/v into qkv): NumPy arrays, or
    QuantizedWeights of one format (per-column scales concatenate with their columns)."""
    if not any(is_quantized(w) for w in ws):
        return np.concatenate(ws, axis=-1)
    _check_same_format(ws)
    return QuantizedWeight(np.concatenate([w.values for w in ws], axis=-1),
                           np.concatenate([w.scale for w in ws], axis=-1))


def stack(ws: list) -> Any:
    """Weights [K, N] stacked on a new leading axis (a MoE layer's experts)."""
    if not any(is_quantized(w) for w in ws):
        return np.stack(ws)
    _check_same_format(ws)
    return QuantizedWeight(np.stack([w.values for w in ws]), np.stack([w.scale for w in ws]))


def _check_same_format(ws: list) -> None:
    kinds = {w.format if is_quantized(w) else "full width" for w in ws}
    if len(kinds) != 1:
        raise ValueError(f"cannot join weights of formats {sorted(kinds)} into one")


def weight_bytes(params: Any, *, quantized_only: bool = False) -> int:
    """Bytes of every array in a params pytree (a QuantizedWeight's values and scales), or
    of its QuantizedWeights alone."""
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    return sum(int(leaf.nbytes) for leaf in leaves
               if is_quantized(leaf) or not quantized_only)


def weight_format(params: Any) -> str | None:
    """The 8-bit format of a params pytree's QuantizedWeights ("int8", "fp8", "int8+fp8"),
    None without any."""
    formats = {leaf.format for leaf in jax.tree.leaves(params, is_leaf=is_quantized)
               if is_quantized(leaf)}
    return "+".join(sorted(formats)) or None


# ------------------------------------------------------------------ the CPU kernel's layout
def quantize_head(params: dict, fmt: str) -> dict:
    """params with the LM head quantized to `fmt`, a scale per vocabulary entry: an untied
    `lm_head` [H, V] as any weight; a tied `embed` [V, H] as the head it also is, a
    QuantizedWeight of [H, V] (`embedding.embed` reads a row back as values[:, v] * scale[v])."""
    if "lm_head" in params:
        return dict(params, lm_head=quantize(params["lm_head"], fmt))
    return dict(params, embed=quantize(np.asarray(params["embed"]).T, fmt))


def packable(w: Any) -> bool:
    """Whether the CPU kernel library packs this weight for its int8 packed matmul: an int8
    [K, N] QuantizedWeight, the library built and offering `packed_matmul_int8`
    (`cpu_ops.packable_int8`: its panel width divides N)."""
    return (is_quantized(w) and not w.packed and w.format == "int8" and w.ndim == 2
            and hasattr(cpu_ops, "packed_matmul_int8") and cpu_ops.available()
            and cpu_ops.packable_int8(w.values))


def pack(w: QuantizedWeight) -> QuantizedWeight:
    """w with its values in the panels `cpu_ops.packed_matmul_int8` streams in order
    (`cpu_ops.pack_weight_int8`; NumPy values pack on the host)."""
    return QuantizedWeight(cpu_ops.pack_weight_int8(w.values), w.scale, packed=True)


# ------------------------------------------------------------------ matmuls
def matmul_f32(x: jax.Array, w: QuantizedWeight, *, live_rows: jax.Array | None = None
               ) -> jax.Array:
    """x [M, K] @ w [K, N] -> float32 [M, N]: (x @ values) * scale. A packed int8 weight
    (CPU only) goes through `cpu_ops.packed_matmul_int8` (rows past `live_rows` are padding
    it leaves as zeros); every other one through XLA's dot of x by the values widened to x's
    dtype, accumulated in float32."""
    if w.packed:
        return cpu_ops.packed_matmul_int8(x, w.values, w.scale, live_rows=live_rows)
    out = jax.lax.dot_general(x, w.values.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return out * w.scale


def expert_matmul(x: jax.Array, w: Any, e: jax.Array) -> jax.Array:
    """x [M, K] @ w[e] in x's dtype: one expert's weight of a MoE layer's stack [E, K, N],
    plain (x @ w[e]) or quantized (`matmul_f32`'s dot, rounded once)."""
    if not is_quantized(w):
        return x @ w[e]
    return matmul_f32(x, w[e]).astype(x.dtype)


def ragged_matmul(x: jax.Array, w: Any, group_sizes: jax.Array, row_expert: jax.Array
                  ) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` in x's dtype: rows of x in groups, group e by
    w[e]; for a quantized w by its values, each row's output scaled by its expert's columns
    (`row_expert` [M]: the expert of each row; rows past the groups are anything)."""
    if not is_quantized(w):
        return jax.lax.ragged_dot(x, w, group_sizes)
    out = jax.lax.ragged_dot(x, w.values.astype(x.dtype), group_sizes,
                             preferred_element_type=jnp.float32)
    scale = jnp.take(w.scale, row_expert, axis=0, mode="clip")  # [M, N]
    return (out * scale).astype(x.dtype)


def expert_einsum(spec: str, x: jax.Array, w: Any) -> jax.Array:
    """`jnp.einsum(spec, x, w)` over a MoE layer's stack w [E, K, N] whose output is
    [E, T, N] (every expert on every token), in x's dtype; a quantized w's values widened
    and its scale [E, N] applied to the output."""
    if not is_quantized(w):
        return jnp.einsum(spec, x, w)
    out = jnp.einsum(spec, x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (out * w.scale[:, None, :]).astype(x.dtype)
