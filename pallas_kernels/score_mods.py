"""Sliding-window masking and attention-logit soft-capping, as the blockwise jnp path and the
Pallas kernels apply them (traced inside their jits or kernel bodies; the window and the cap
are static). The dense reference (`reference.py`) spells both out on its own: it is the
oracle the others are held to.

A query at position p with window W sees the keys at positions (p - W, p], itself included
(HF's `kv_idx > q_idx - sliding_window`); no window: every key up to p. Soft-capping (Gemma
2) maps the scaled scores s to cap * tanh(s / cap), before masking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """The scores soft-capped (unchanged when `cap` is None)."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def visible(key_pos: jax.Array, query_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Whether a query at `query_pos` sees the key at `key_pos` (broadcasting): causal, and
    inside the window."""
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def first_key(query_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """The first key position a query at `query_pos` sees (0 without a window)."""
    if sliding_window is None:
        return jnp.zeros_like(query_pos)
    return jnp.maximum(query_pos - sliding_window + 1, 0)
