"""Blockwise online-softmax paged attention in plain jnp: the portable path (any platform
and dtype; on CPU the C++ kernel in cpu_ops.py is the default), plus `write_kv`, which
scatters a step's K/V into the pool.

`paged_attention_blockwise` has the same contract as the dense oracle
`reference.paged_attention_reference` (ragged, token-flat batch; each query attends causally
to its sequence's earlier tokens and itself) and is tested against it, but gathers one chunk
of KV blocks at a time and folds it into an online softmax (flash attention in jnp) instead
of materializing every sequence's K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import bits, quantized, score_mods


def write_kv(
    k_pool: jax.Array, v_pool: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V into the pool.

    Args:
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim], or QuantizedPools
        of that shape (k and v are quantized per (head, token) as they are written).
      k, v: [T, num_kv_heads, head_dim].
      slot_mapping: [T] int32, slot = block_id * block_size + offset; padding tokens
        point into the reserved block 0.
    """
    def scatter(pool, new):  # new: [T, K, D] -> written at [:, slot, :] of [K, slots, D]
        if quantized.is_quantized(pool):
            values, scales = quantized.quantize(new.transpose(1, 0, 2), pool.dtype)
            return quantized.QuantizedPool(bits.set_rows(pool.values, slot_mapping, values),
                                           bits.set_rows(pool.scales, slot_mapping, scales))
        return bits.set_rows(jnp.asarray(pool), slot_mapping, new, token_major=True)

    return scatter(k_pool, k), scatter(v_pool, v)


@functools.partial(jax.jit,
                   static_argnames=("max_query_len", "scale", "blocks_per_chunk", "query_tile",
                                    "sliding_window", "soft_cap"))
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
    query_tile: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Same contract as `reference.paged_attention_reference`, computed chunk by chunk of KV blocks
    with an online softmax (flash attention in plain jnp): the portable path.

    The dense reference materializes every sequence's gathered K/V and pads every sequence's
    queries to `max_query_len`, which on CPU costs far more than the arithmetic. Here a loop
    gathers one chunk of blocks at a time and runs only as many iterations as the longest
    sequence needs. Decode batches (one query per sequence) and prefill chunks take
    different loops, each shaped for what XLA:CPU runs fast (see `_decode` and `_prefill`).
    `blocks_per_chunk` and `query_tile` override the measured defaults (tests use them).

    With a `sliding_window`, each sequence (decode) or query tile (prefill) starts its loop at
    the block holding the first key its earliest query sees: blocks before it are never
    gathered (a sliding layer's pool may have freed them; their table entries may name any
    block) and a long sequence costs only its window.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k_pool, v_pool, block_tables, seq_lens, query_start_loc)
    options = dict(scale=scale, blocks_per_chunk=blocks_per_chunk,
                   sliding_window=sliding_window, soft_cap=soft_cap)
    if max_query_len == 1:
        return _decode(*args, **options)
    return _prefill(*args, max_query_len=max_query_len, query_tile=query_tile, **options)


def _online_softmax_step(carry, scores, key_axis: int, attend_values):
    """Fold one chunk of masked scores (-inf = masked) into (row_max, denom, acc).

    `attend_values(probs)` returns this chunk's probs @ V in acc's layout."""
    row_max, denom, acc = carry
    new_max = jnp.maximum(row_max, scores.max(key_axis))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with no key yet
    probs = jnp.exp(scores - jnp.expand_dims(safe_max, key_axis))
    had_keys = jnp.isfinite(row_max)
    correction = jnp.where(had_keys, jnp.exp(jnp.where(had_keys, row_max, 0.0) - safe_max), 0.0)
    denom = denom * correction + probs.sum(key_axis)
    acc = acc * correction[..., None] + attend_values(probs)
    return new_max, denom, acc


def _decode(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, scale,
            blocks_per_chunk, sliding_window, soft_cap):
    """One query per sequence: loop over 64-token chunks of the sequences' blocks.

    A loop over chunks runs as long as the longest sequence it serves, so the sequences are
    sorted by length and served in tiers (the longest eighth, the next eighth, quarter,
    half): in a long-tailed batch the short half stops after its own few chunks instead of
    idling through the longest sequence's.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = k_pool.shape[0]
    group = num_heads // num_kv_heads
    # sequence s's query (if it has one) is token query_start_loc[s]
    has_query = query_start_loc[1:] > query_start_loc[:-1]  # [S]
    token_index = jnp.where(has_query, query_start_loc[:-1], num_tokens)  # T = none
    order = jnp.argsort(-seq_lens)  # longest first
    token_index, tables, lens = token_index[order], block_tables[order], seq_lens[order]
    q_seq = q.at[token_index].get(mode="fill", fill_value=0) * scale  # [S, H, D]
    q_seq = q_seq.reshape(num_seqs, num_kv_heads, group, head_dim).astype(jnp.float32)
    out = jnp.concatenate([
        _decode_tier(q_seq[lo:hi], k_pool, v_pool, tables[lo:hi], lens[lo:hi], blocks_per_chunk,
                     sliding_window, soft_cap)
        for lo, hi in _tiers(num_seqs, smallest=8)])  # [S, K, G, D]
    out = out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
    return jnp.zeros_like(q).at[token_index].set(out, mode="drop")


def _as_rows(pool) -> tuple:
    """(read, head_row): `read(rows)` gathers rows of one (head, block) of the pool [K, NB, B,
    D] viewed as [K * NB, B * D] (on CPU a gather of whole rows is a memcpy per row) and
    returns them [n, B * D], dequantized to float32 for a QuantizedPool; head_row [K] is each
    head's first row."""
    num_kv_heads, num_blocks, block_size, head_dim = pool.shape
    rows = jax.tree.map(lambda x: x.reshape(num_kv_heads * num_blocks, *x.shape[2:]), pool)

    def read(index):
        return bits.take_pool(rows, index).reshape(index.shape[0], block_size * head_dim)

    return read, jnp.arange(num_kv_heads, dtype=jnp.int32) * num_blocks


def _pad_to_chunks(tables: jax.Array, blocks_per_chunk: int) -> tuple[jax.Array, int]:
    """The block table padded to whole chunks (padding entries point at block 0 and are
    masked by length), and the number of chunks."""
    width = tables.shape[1]
    num_chunks = -(-width // blocks_per_chunk)
    return jnp.pad(tables, ((0, 0), (0, num_chunks * blocks_per_chunk - width))), num_chunks


def _window_start(tables: jax.Array, first_query_pos: jax.Array, block_size: int,
                  sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """Each row's block table shifted to begin at the block holding the first key its earliest
    query (at `first_query_pos`, [rows]) sees, and that block's first key position [rows].

    Entries before that block may name any block (a sliding layer's pool frees the blocks that
    left the window), so the chunk loop must never gather them; entries shifted in past the
    table's end point at block 0 and are masked by length. Without a window: the tables as
    they are, from key 0."""
    if sliding_window is None:
        return tables, jnp.zeros(tables.shape[0], jnp.int32)
    first_block = score_mods.first_key(first_query_pos, sliding_window) // block_size
    cols = first_block[:, None] + jnp.arange(tables.shape[1], dtype=jnp.int32)[None, :]
    tables = jnp.take_along_axis(tables, cols, axis=1, mode="fill", fill_value=0)
    return tables, first_block * block_size


def _attend_chunks(body, rows_shape, head_dim, spans, chunk, num_chunks):
    """Run `body(c, (row_max, denom, acc))` over key chunks, only as many as the longest
    span (keys from a row's first gathered block to its last key) needs; returns
    acc / denom (rows with no key: 0), shape rows_shape + (D,)."""
    init = (jnp.full(rows_shape, -jnp.inf, jnp.float32), jnp.zeros(rows_shape, jnp.float32),
            jnp.zeros((*rows_shape, head_dim), jnp.float32))
    needed = (jnp.max(spans) + chunk - 1) // chunk
    _, denom, acc = jax.lax.fori_loop(0, jnp.minimum(needed, num_chunks), body, init)
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


def _tiers(num_rows: int, *, smallest: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges over rows sorted longest first: the last (shortest) half, then the
    shortest half of the rest, while the rest is over `smallest` rows and even; at most 4
    tiers. Decode (smallest 8): 64 rows -> sizes 8, 8, 16, 32; 48 -> 6, 6, 12, 24; 12 -> 6,
    6. Prefill tiles (smallest 1): 8 -> 1, 1, 2, 4; 12 -> 3, 3, 6."""
    bounds = [num_rows]
    while bounds[-1] > smallest and bounds[-1] % 2 == 0 and len(bounds) < 4:
        bounds.append(bounds[-1] // 2)
    bounds.append(0)
    return list(zip(bounds[::-1][:-1], bounds[::-1][1:], strict=True))


def _decode_tier(q_seq, k_pool, v_pool, tables, seq_lens, blocks_per_chunk, sliding_window,
                 soft_cap):
    """Attention of one query per sequence, [S, K, G, D], over its blocks.

    Each chunk's K/V is gathered as whole (head, block) rows of the flattened pool, straight
    into [S, K, C, D] (a row gather is a memcpy per row; indexing the head-major pool as
    `pool[:, ids]` and transposing made 30 layers of decode attention 13-19% slower). The
    per-(sequence, head) matrices are tiny (a GQA group of query rows by one chunk of keys),
    so the contractions are broadcast-multiply-reduce over memory that stays in cache; measured
    faster than einsums over the same chunks. Gathering is the cost: a b64 step reads K/V at
    5-6 GB/s, at or below the 6.6-12.4 GB/s this 2-core machine copies at across runs
    (scripts/bench_attention.py)."""
    num_seqs, num_kv_heads, group, head_dim = q_seq.shape
    block_size = k_pool.shape[2]
    blocks_per_chunk = blocks_per_chunk or max(1, 64 // block_size)  # measured best on CPU
    chunk = blocks_per_chunk * block_size
    # the one query of each sequence is its last token, at seq_len - 1
    tables, key_start = _window_start(tables, seq_lens - 1, block_size, sliding_window)
    tables, num_chunks = _pad_to_chunks(tables, blocks_per_chunk)
    (read_k, head_row), (read_v, _) = _as_rows(k_pool), _as_rows(v_pool)

    def body(c, carry):
        ids = jax.lax.dynamic_slice_in_dim(tables, c * blocks_per_chunk, blocks_per_chunk, 1)
        rows = (ids[:, None, :] + head_row[None, :, None]).reshape(-1)  # [S * K * blocks]
        k = read_k(rows).reshape(num_seqs, num_kv_heads, chunk, head_dim)  # [S, K, C, D]
        v = read_v(rows).reshape(num_seqs, num_kv_heads, chunk, head_dim)
        key_pos = key_start[:, None] + c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [S, C]
        # the query at seq_len - 1 sees the keys visible to it; those past it are unowned
        key_valid = score_mods.visible(key_pos, (seq_lens - 1)[:, None], sliding_window)  # [S, C]
        # slots past a sequence's length may hold anything (even NaN): 0 * NaN must not leak
        v = jnp.where(key_valid[:, None, :, None], v, 0).astype(jnp.float32)
        # [S, K, G, D] x [S, K, C, D] -> [S, K, G, C]
        scores = score_mods.soft_cap(_contract_d(q_seq, k.astype(jnp.float32)), soft_cap)
        scores = jnp.where(key_valid[:, None, None, :], scores, -jnp.inf)
        # [S, K, G, C] x [S, K, C, D] -> [S, K, G, D]
        return _online_softmax_step(carry, scores, 3, lambda p: _contract_c(p, v))

    return _attend_chunks(body, (num_seqs, num_kv_heads, group), head_dim, seq_lens - key_start,
                          chunk, num_chunks)


def _prefill(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, max_query_len,
             scale, blocks_per_chunk, query_tile, sliding_window, soft_cap):
    """Ragged prefill chunks: queries cut into tiles, keys in 128-token chunks.

    Padding every sequence's queries to `max_query_len` costs S x max_query_len rows (a
    step with one long chunk and many short ones pays up to S times the work), so the
    queries are cut into tiles of `query_tile` tokens, each belonging to one sequence: at
    most T / tile + S tiles, and tile * S <= T keeps that under 2T rows. Per KV head and
    tile, the contractions are real matmuls ([chunk, D] x [D, G * tile]).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, max_blocks = block_tables.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_heads // num_kv_heads
    tile = query_tile or _default_tile(max_query_len, num_seqs, num_tokens)
    num_tiles = min(num_tokens, -(-num_tokens // tile) + num_seqs)
    rows = group * tile

    # Tile t belongs to sequence tile_seq[t] and holds its queries first[t] * tile + [0, tile).
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    tiles_per_seq = (query_lens + tile - 1) // tile
    tiles_end = jnp.cumsum(tiles_per_seq)  # [S]
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.searchsorted(tiles_end, tile_ids, side="right").astype(jnp.int32)
    real_tile = tile_seq < num_seqs  # trailing tiles are padding
    tile_seq = jnp.minimum(tile_seq, num_seqs - 1)
    first = tile_ids - (tiles_end - tiles_per_seq)[tile_seq]
    offset = first[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)[None, :]  # [NT, tile]
    tile_qlen = query_lens[tile_seq][:, None]
    valid = real_tile[:, None] & (offset < tile_qlen)
    token_index = jnp.where(valid, query_start_loc[tile_seq][:, None] + offset, num_tokens)
    lens = jnp.where(real_tile, seq_lens[tile_seq], 0)  # [NT] keys visible to the tile
    query_pos = lens[:, None] - tile_qlen + offset  # [NT, tile]: the queries are the last tokens
    # causal reach of each tile: keys past its last query's position are masked anyway
    reach = jnp.max(jnp.where(valid, query_pos + 1, 0), axis=1)  # [NT]
    first_query_pos = query_pos[:, 0]  # [NT] a tile's queries are in position order
    query_pos = jnp.tile(query_pos, (1, group))  # [NT, G*tile], matching q_tiles' rows
    q_tiles = q.at[token_index].get(mode="fill", fill_value=0) * scale  # [NT, tile, H, D]
    q_tiles = q_tiles.reshape(num_tiles, tile, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(2, 0, 3, 1, 4).reshape(num_kv_heads, num_tiles, rows, head_dim)
    q_tiles = q_tiles.astype(jnp.float32)

    blocks_per_chunk = min(blocks_per_chunk or max(1, 128 // block_size), max_blocks)
    chunk = blocks_per_chunk * block_size
    tables, key_start = _window_start(block_tables[tile_seq], first_query_pos, block_size,
                                      sliding_window)  # [NT, width], [NT]
    tables, num_chunks = _pad_to_chunks(tables, blocks_per_chunk)
    span = reach - key_start  # [NT] keys from the tile's first gathered block to its reach
    (read_k, head_row), (read_v, _) = _as_rows(k_pool), _as_rows(v_pool)

    def attend_tier(q_tiles, tables, lens, query_pos, key_start, span):
        num = tables.shape[0]

        def body(c, carry):
            ids = jax.lax.dynamic_slice_in_dim(tables, c * blocks_per_chunk, blocks_per_chunk, 1)
            rows = (ids[None] + head_row[:, None, None]).reshape(-1)  # [K * n * blocks]
            k = read_k(rows).reshape(num_kv_heads, num, chunk, head_dim)  # [K, n, C, D]
            v = read_v(rows).reshape(num_kv_heads, num, chunk, head_dim)
            key_pos = key_start[:, None] + c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            key_valid = key_pos < lens[:, None]  # [n, C]
            v = jnp.where(key_valid[None, :, :, None], v, 0).astype(jnp.float32)
            # keys as the matmul's long side: [K, n, C, D] x [K, n, R, D] -> [K, n, C, R]
            scores = jnp.einsum("ktcd,ktrd->ktcr", k.astype(jnp.float32), q_tiles)
            scores = score_mods.soft_cap(scores, soft_cap)
            mask = key_valid[:, :, None] & score_mods.visible(
                key_pos[:, :, None], query_pos[:, None, :], sliding_window)
            scores = jnp.where(mask[None], scores, -jnp.inf)
            # [K, n, C, R] x [K, n, C, D] -> [K, n, R, D]
            return _online_softmax_step(
                carry, scores, 2, lambda p: jnp.einsum("ktcr,ktcd->ktrd", p, v))

        return _attend_chunks(body, (num_kv_heads, num, rows), head_dim, span, chunk,
                              num_chunks)

    # Tiles sorted by span (without a window, their reach) and served in tiers, as decode's
    # sequences are: a tile early in a long chunk, or of a short sequence, stops at its own
    # last key. Tiles are few (often 8 or 16, the last S of them padding) and heavy (G * tile
    # query rows), so tiers go down to single tiles: a 512-token chunk's 4 tiles reach 4, 3,
    # 2, 1 key chunks and its 4 padding tiles none; as one tier all 8 ran 4 chunks (32
    # tile-chunks), as 1, 1, 2, 4 they run 11. Costs compile time: a loop per tier and layer.
    order = jnp.argsort(-span)
    q_tiles, tables, lens, query_pos, key_start, span = (
        q_tiles[:, order], tables[order], lens[order], query_pos[order], key_start[order],
        span[order])
    out = jnp.concatenate([
        attend_tier(q_tiles[:, lo:hi], tables[lo:hi], lens[lo:hi], query_pos[lo:hi],
                    key_start[lo:hi], span[lo:hi]) for lo, hi in _tiers(num_tiles, smallest=1)],
        axis=1)
    out = out[:, jnp.argsort(order)]  # [K, NT, G*tile, D], back in tile order
    out = out.reshape(num_kv_heads, num_tiles, group, tile, head_dim).transpose(1, 3, 0, 2, 4)
    out = out.reshape(num_tiles * tile, num_heads, head_dim)
    result = jnp.zeros_like(q)
    return result.at[token_index.reshape(-1)].set(out.astype(q.dtype), mode="drop")


def _default_tile(max_query_len: int, num_seqs: int, num_tokens: int) -> int:
    """Largest power of two <= min(max_query_len, 128) with tile * num_seqs <= num_tokens."""
    tile = 1
    while tile * 2 <= min(max_query_len, 128) and tile * 2 * num_seqs <= num_tokens:
        tile *= 2
    return tile


# The per-(sequence, head) matrices of a decode step are tiny (a few query rows by one chunk
# of keys): as dot_generals, XLA:CPU issues one small GEMM per batch element; as
# broadcast-multiply-reduce they fuse into a single loop over memory that stays in cache.
def _contract_d(q: jax.Array, k: jax.Array) -> jax.Array:
    """[S, K, Q, D] x [S, K, C, D] -> [S, K, Q, C] (sum over D)."""
    return (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)


def _contract_c(p: jax.Array, v: jax.Array) -> jax.Array:
    """[S, K, Q, C] x [S, K, C, D] -> [S, K, Q, D] (sum over C)."""
    return (p[..., None] * v[:, :, None, :, :]).sum(-2)
