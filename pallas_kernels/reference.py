"""Pure-jnp dense paged attention over a block pool: the oracle the kernels and the
blockwise jnp path (blockwise.py) are tested against. Simple over fast: it materializes every
sequence's gathered K/V.

The batch is ragged and token-flat, as the engine packs it: `T` query tokens belonging to
`S` sequences, sequence `s` owning tokens `query_start_loc[s]:query_start_loc[s + 1]`.
Those are the *last* tokens of the sequence: a decode step has one, a prefill chunk has
many. Each query attends causally to every earlier token of its sequence (the cached
prefix read through the block table, plus the earlier tokens of its own chunk, which the
caller has already written into the pool) and to itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import bits

_NEG_INF = float("-inf")


@functools.partial(jax.jit, static_argnames=("max_query_len", "scale", "sliding_window",
                                             "soft_cap"))
def paged_attention_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of a ragged batch of queries over paged K/V.

    Args:
      q: [T, num_heads, head_dim] queries (already rotated).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim] (float, or a
        `quantized.QuantizedPool`, read dequantized); this step's K/V must already be written.
      block_tables: [S, max_blocks_per_seq] int32 physical block ids; entries past a
        sequence's length are never read (padding points at block 0).
      seq_lens: [S] int32 total tokens of each sequence including this step's queries.
        A padded sequence has length 0 and no queries.
      query_start_loc: [S + 1] int32 offsets of each sequence's queries in `q`
        (non-decreasing; `query_start_loc[S] <= T`, tokens past it are padding).
      max_query_len: static upper bound on queries per sequence (1 for pure decode).
      scale: softmax scale, default head_dim ** -0.5.
      sliding_window: a query at position p sees only the keys at positions
        (p - sliding_window, p] (HF's convention: `sliding_window` keys, itself included).
        Block-table entries of blocks wholly before every query's window may hold anything
        (a sliding layer's pool frees them) and are never read into the output.
      soft_cap: Gemma 2's attention-logit soft-capping, scores -> cap * tanh(scores / cap),
        applied to the scaled scores before masking.

    Returns:
      [T, num_heads, head_dim] in q's dtype; rows of padding tokens are zero.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, max_blocks = block_tables.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    max_len = max_blocks * block_size

    # Queries of each sequence, packed densely: [S, Qm] token index (T = out of range).
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    offsets = jnp.arange(max_query_len, dtype=jnp.int32)  # [Qm]
    query_valid = offsets[None, :] < query_lens[:, None]  # [S, Qm]
    token_index = jnp.where(query_valid, query_start_loc[:-1, None] + offsets, num_tokens)
    q_dense = q.at[token_index].get(mode="fill", fill_value=0)  # [S, Qm, H, D]
    q_dense = q_dense.reshape(num_seqs, max_query_len, num_kv_heads, group, head_dim)
    # Position of each query within its sequence: the queries are the last tokens.
    query_pos = seq_lens[:, None] - query_lens[:, None] + offsets[None, :]  # [S, Qm]

    # K/V of each sequence gathered through its block table.
    k = bits.take_pool(k_pool, (slice(None), block_tables))
    k = k.reshape(num_kv_heads, num_seqs, max_len, head_dim)  # [K, S, L, D]
    v = bits.take_pool(v_pool, (slice(None), block_tables))
    v = v.reshape(num_kv_heads, num_seqs, max_len, head_dim)  # [K, S, L, D]
    key_pos = jnp.arange(max_len, dtype=jnp.int32)  # [L]
    key_valid = key_pos[None, :] < seq_lens[:, None]  # [S, L]
    if sliding_window is not None:  # keys before the first query's window may be anything
        first_query = seq_lens - query_lens  # [S]
        key_valid &= key_pos[None, :] > (first_query - sliding_window)[:, None]
    # Slots past a sequence's length may hold anything (even NaN): zero them so that
    # 0 * garbage never reaches the output.
    v = jnp.where(key_valid[None, :, :, None], v, 0)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & key_valid[:, None, :]  # [S, Qm, L]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window

    # [S, Qm, K, G, D] x [K, S, L, D] -> [S, K, G, Qm, L]
    scores = jnp.einsum(
        "sqkgd,ksld->skgql", q_dense, k, preferred_element_type=jnp.float32
    ) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # rows with no keys: padding
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    # [S, K, G, Qm, L] x [K, S, L, D] -> [S, Qm, K, G, D]
    out = jnp.einsum("skgql,ksld->sqkgd", probs, v.astype(jnp.float32))
    out = out.reshape(num_seqs * max_query_len, num_heads, head_dim).astype(q.dtype)

    # Back to the token-flat layout; padded queries scatter out of range and are dropped.
    result = jnp.zeros_like(q)
    return result.at[token_index.reshape(-1)].set(out, mode="drop")
