"""Multi-LoRA deltas: each row of a step adds its adapter's low-rank product to a projection.

A step's rows each carry an adapter slot (0: none); a projection y = x @ W of them then adds,
row by row, `delta[t] = X(x[t] @ a[slots[t]]) @ b[slots[t]]` for the adapters' stacked A [S, K,
R] and B [S, R, N] (X: x's dtype, the intermediate rounded once to it, as PyTorch's bfloat16
`lora_B(lora_A(x))`). `lora_matmul` is the op the engine calls: on XLA:CPU the kernel library's
grouped shrink-and-expand (`cpu_ops.lora_matmul`: the rows grouped by slot, each adapter read
once a call), where XLA's own forms gather every row's A and B, or run every row against every
adapter; on other platforms, and where the library is not available, the jnp reference
`lora_matmul_reference` (per-row gathers and einsums), which is also the tests' yardstick.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ops, lowering


def _live_mask(slots: jax.Array, num_slots: int, live_rows) -> jax.Array:
    """[T] bool: the rows that take an adapter (0 < slot < S, before `live_rows`)."""
    active = (slots > 0) & (slots < num_slots)
    if live_rows is not None:
        rows = jnp.arange(slots.shape[0], dtype=jnp.int32)
        active &= rows < jnp.asarray(live_rows, jnp.int32).reshape(())
    return active


def lora_matmul_reference(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array,
                          slots: jax.Array, live_rows: jax.Array | int | None = None
                          ) -> jax.Array:
    """`cpu_ops.lora_matmul`'s contract in jnp, for any platform: y [T, N] float32 plus, for
    each row t < `live_rows` (every row where None) with 0 < slots[t] < S, X(x[t] @ a[s]) @ b[s]
    (s = slots[t]; x [T, K], a [S, K, R], b [S, R, N] of one float dtype X; float32 products
    and sums, the intermediate rounded to X); the other rows keep y. Gathers each row's A and
    B ([T, K, R] and [T, R, N]) and contracts them row by row."""
    cpu_ops.check_lora_operands(y, x, a, b, slots)
    if a.shape[0] == 0:  # no adapters at all (nothing to gather from)
        return y
    slots = slots.astype(jnp.int32)
    active = _live_mask(slots, a.shape[0], live_rows)
    index = jnp.where(active, slots, 0)  # in range for the gathers; those rows keep y below
    tmp = jnp.einsum("tk,tkr->tr", x, a[index], preferred_element_type=jnp.float32)
    delta = jnp.einsum("tr,trn->tn", tmp.astype(x.dtype), b[index],
                       preferred_element_type=jnp.float32)
    return jnp.where(active[:, None], y + delta, y)


def lora_matmul(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                live_rows: jax.Array | int | None = None) -> jax.Array:
    """y + each row's LoRA delta (`lora_matmul_reference`'s contract): on XLA:CPU the kernel
    library's `cpu_ops.lora_matmul` where it is `available()` and x is float32 or bfloat16,
    elsewhere (and for programs lowered for GPU or TPU, `lowering.choose`) the jnp reference."""
    cpu_ops.check_lora_operands(y, x, a, b, slots)
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows, jnp.int32).reshape(())
    if (jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in cpu_ops.LORA_DTYPES]
            or not cpu_ops.available()):
        return lora_matmul_reference(y, x, a, b, slots, live)
    return lowering.choose(y, x, a, b, slots, live, cpu=cpu_ops.lora_matmul,
                           default=lora_matmul_reference)
