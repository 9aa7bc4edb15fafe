"""Pure-jnp paged attention over a block pool: the CPU path and the oracle for the kernels.

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

_NEG_INF = float("-inf")


@functools.partial(jax.jit, static_argnames=("max_query_len", "scale"))
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
) -> jax.Array:
    """Attention of a ragged batch of queries over paged K/V.

    Args:
      q: [T, num_heads, head_dim] queries (already rotated).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim]; this step's K/V
        must already be written.
      block_tables: [S, max_blocks_per_seq] int32 physical block ids; entries past a
        sequence's length are never read (padding points at block 0).
      seq_lens: [S] int32 total tokens of each sequence including this step's queries.
        A padded sequence has length 0 and no queries.
      query_start_loc: [S + 1] int32 offsets of each sequence's queries in `q`
        (non-decreasing; `query_start_loc[S] <= T`, tokens past it are padding).
      max_query_len: static upper bound on queries per sequence (1 for pure decode).
      scale: softmax scale, default head_dim ** -0.5.

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
    k = k_pool[:, block_tables].reshape(num_kv_heads, num_seqs, max_len, head_dim)  # [K, S, L, D]
    v = v_pool[:, block_tables].reshape(num_kv_heads, num_seqs, max_len, head_dim)  # [K, S, L, D]
    key_pos = jnp.arange(max_len, dtype=jnp.int32)  # [L]
    key_valid = key_pos[None, :] < seq_lens[:, None]  # [S, L]
    # Slots past a sequence's length may hold anything (even NaN): zero them so that
    # 0 * garbage never reaches the output.
    v = jnp.where(key_valid[None, :, :, None], v, 0)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & key_valid[:, None, :]  # [S, Qm, L]

    # [S, Qm, K, G, D] x [K, S, L, D] -> [S, K, G, Qm, L]
    scores = jnp.einsum(
        "sqkgd,ksld->skgql", q_dense, k, preferred_element_type=jnp.float32
    ) * scale
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


def write_kv(
    k_pool: jax.Array, v_pool: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V into the pool.

    Args:
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim].
      k, v: [T, num_kv_heads, head_dim].
      slot_mapping: [T] int32, slot = block_id * block_size + offset; padding tokens
        point into the reserved block 0.
    """
    shape = k_pool.shape  # [num_kv_heads, num_blocks, block_size, head_dim]
    flat_shape = (shape[0], shape[1] * shape[2], shape[3])

    def scatter(pool, new):  # new: [T, K, D] -> written at [:, slot, :]
        pool = jnp.asarray(pool).reshape(flat_shape)
        new = new.astype(pool.dtype).transpose(1, 0, 2)
        return pool.at[:, slot_mapping].set(new).reshape(shape)

    return scatter(k_pool, k), scatter(v_pool, v)


@functools.partial(jax.jit, static_argnames=("max_query_len", "scale", "blocks_per_chunk"))
def paged_attention_blockwise(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    blocks_per_chunk: int | None = None,
) -> jax.Array:
    """Same contract as `paged_attention_reference`, computed chunk by chunk of KV blocks
    with an online softmax (flash-decoding in plain jnp).

    The dense reference materializes every sequence's gathered K/V ([S, L, K, D]) and
    transposes it, which on CPU costs far more than the arithmetic; here a loop gathers
    `blocks_per_chunk` blocks of every sequence at a time (a few MB that stay in cache) and
    runs only as many iterations as the longest sequence in the batch needs.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, max_blocks = block_tables.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    # ~16 tokens per iteration measured fastest on CPU (the gather stays in L2)
    blocks_per_chunk = blocks_per_chunk or max(1, 16 // block_size)
    chunk = blocks_per_chunk * block_size
    num_chunks = -(-max_blocks // blocks_per_chunk)
    # pad the table to whole chunks (padding entries point at block 0 and are masked)
    pad = num_chunks * blocks_per_chunk - max_blocks
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))

    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    offsets = jnp.arange(max_query_len, dtype=jnp.int32)  # [Qm]
    query_valid = offsets[None, :] < query_lens[:, None]  # [S, Qm]
    token_index = jnp.where(query_valid, query_start_loc[:-1, None] + offsets, num_tokens)
    q_dense = q.at[token_index].get(mode="fill", fill_value=0) * scale  # [S, Qm, H, D]
    # [S, K, G*Qm, D]: all query heads of a KV head and all queries of a sequence together
    q_dense = q_dense.reshape(num_seqs, max_query_len, num_kv_heads, group, head_dim)
    q_dense = q_dense.transpose(0, 2, 3, 1, 4).reshape(
        num_seqs, num_kv_heads, group * max_query_len, head_dim).astype(jnp.float32)
    query_pos = seq_lens[:, None] - query_lens[:, None] + offsets[None, :]  # [S, Qm]
    query_pos = jnp.tile(query_pos, (1, group))  # [S, G*Qm], matching q_dense's rows

    def body(c, carry):
        row_max, denom, acc = carry  # [S, K, GQ], [S, K, GQ], [S, K, GQ, D]
        ids = jax.lax.dynamic_slice_in_dim(tables, c * blocks_per_chunk, blocks_per_chunk, 1)
        k = k_pool[:, ids].reshape(num_kv_heads, num_seqs, chunk, head_dim)  # [K, S, C, D]
        v = v_pool[:, ids].reshape(num_kv_heads, num_seqs, chunk, head_dim)  # [K, S, C, D]
        key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        key_valid = key_pos[None, :] < seq_lens[:, None]  # [S, C]
        v = jnp.where(key_valid[None, :, :, None], v, 0).astype(jnp.float32)
        # [S, K, GQ, D] x [K, S, C, D] -> [S, K, GQ, C]
        scores = _contract_d(q_dense, k.astype(jnp.float32))
        mask = key_valid[:, None, None, :] & (
            key_pos[None, None, None, :] <= query_pos[:, None, :, None])  # [S, 1, GQ, C]
        scores = jnp.where(mask, scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(scores - safe_max[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max, 0.0) - safe_max)
        correction = jnp.where(jnp.isfinite(row_max), correction, 0.0)
        denom = denom * correction + probs.sum(-1)
        # [S, K, GQ, C] x [K, S, C, D] -> [S, K, GQ, D]
        acc = acc * correction[..., None] + _contract_c(probs, v)
        return new_max, denom, acc

    rows = group * max_query_len
    init = (jnp.full((num_seqs, num_kv_heads, rows), -jnp.inf, jnp.float32),
            jnp.zeros((num_seqs, num_kv_heads, rows), jnp.float32),
            jnp.zeros((num_seqs, num_kv_heads, rows, head_dim), jnp.float32))
    # only as many chunks as the longest sequence needs
    needed = (jnp.max(seq_lens) + chunk - 1) // chunk
    _, denom, acc = jax.lax.fori_loop(0, jnp.minimum(needed, num_chunks), body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [S, K, G*Qm, D]
    out = out.reshape(num_seqs, num_kv_heads, group, max_query_len, head_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_seqs * max_query_len, num_heads, head_dim)
    result = jnp.zeros_like(q)
    return result.at[token_index.reshape(-1)].set(out.astype(q.dtype), mode="drop")


# The per-(sequence, head) matrices here are tiny (a few query rows by one chunk of keys):
# as dot_generals, XLA:CPU issues one small GEMM per batch element; as broadcast-multiply-
# reduce they fuse into a single loop over memory that stays in cache.
def _contract_d(q: jax.Array, k: jax.Array) -> jax.Array:
    """[S, K, Q, D] x [K, S, C, D] -> [S, K, Q, C] (sum over D)."""
    k = k.transpose(1, 0, 2, 3)  # [S, K, C, D]
    return (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)


def _contract_c(p: jax.Array, v: jax.Array) -> jax.Array:
    """[S, K, Q, C] x [K, S, C, D] -> [S, K, Q, D] (sum over C)."""
    v = v.transpose(1, 0, 2, 3)  # [S, K, C, D]
    return (p[..., None] * v[:, :, None, :, :]).sum(-2)
