"""Cutting a ragged, token-flat batch of queries into the fixed-size tiles a kernel program
takes. Shared by the ragged paged-attention kernels (GPU and TPU).

A step's queries are `T` tokens of `S` sequences, sequence `s` owning tokens
`query_start_loc[s]:query_start_loc[s + 1]` (the last tokens of the sequence: one for
decode, a chunk for prefill). A *tile* is `tokens_per_tile` consecutive queries of one
sequence together with the whole GQA group of query heads of one KV head: row
`r = t * group + g` of a tile is query token `t` of the tile, query head `g` of the group, so
the `[rows, head_dim]` tile times a `[keys, head_dim]` K block is one matrix product that
serves all heads sharing the K/V. A sequence of `n` queries takes `cdiv(n, tokens_per_tile)`
tiles; a decode step's sequence takes one tile with `group` live rows.

Everything here is plain jnp on the query-sized arrays (never the pool), traced inside the
caller's jit: the kernel gets the tiles, and per tile the sequence it belongs to and how many
keys it reads, and per row the position of its query (-1 for rows no query fills).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import score_mods


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Static shape of the tiling: `num_tiles` tiles of `rows` rows, `tokens_per_tile`
    query tokens of `group` heads each (rows past `tokens_per_tile * group` are padding)."""

    num_tiles: int
    rows: int
    tokens_per_tile: int
    group: int


def tile_layout(num_tokens: int, num_seqs: int, group: int, max_query_len: int,
                *, decode_rows: int, prefill_rows: int,
                round_rows=lambda n: n) -> TileLayout:
    """The layout for a step of `num_tokens` queries of at most `num_seqs` sequences.

    A pure decode step (`max_query_len` 1) gets tiles of one token (`decode_rows` is the
    fewest rows a tile may have, e.g. 16 for a tensor-core product); otherwise tiles aim at
    `prefill_rows` rows. `round_rows` rounds a row count up to what the kernel can tile
    (a power of 2 for Triton, a multiple of the sublanes for Mosaic).
    """
    if max_query_len <= 1:
        tokens_per_tile = 1
    else:
        tokens_per_tile = max(1, min(max_query_len, prefill_rows // group))
    rows = round_rows(max(decode_rows, tokens_per_tile * group))
    tokens_per_tile = rows // group  # fill the rounded tile
    if max_query_len <= 1:
        tokens_per_tile = 1
    # every tile holds >= 1 query and a sequence wastes < 1 tile: both bound the count
    num_tiles = max(1, min(num_tokens, -(-num_tokens // tokens_per_tile) + num_seqs))
    return TileLayout(num_tiles=num_tiles, rows=rows, tokens_per_tile=tokens_per_tile,
                      group=group)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tiles:
    """Per-tile and per-row facts of one step (traced arrays).

    tile_seq: [num_tiles] int32 sequence of each tile (0 for tiles no query fills).
    tile_kv_len: [num_tiles] int32 keys the tile reads: its last query's position + 1
      (0 for empty tiles).
    row_pos: [num_tiles, rows] int32 position in its sequence of each row's query, -1 for
      rows no query fills.
    row_token: [num_tiles, rows] int32 index of each row's query in the flat batch, T for
      rows no query fills.
    """

    tile_seq: jax.Array
    tile_kv_len: jax.Array
    row_pos: jax.Array
    row_token: jax.Array


def make_tiles(layout: TileLayout, seq_lens: jax.Array, query_start_loc: jax.Array,
               num_tokens: int) -> Tiles:
    """Assign the batch's queries to tiles: sequence by sequence, `tokens_per_tile` at a
    time. Sequences with no queries (padding) take no tile."""
    bq, group = layout.tokens_per_tile, layout.group
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    tiles_per_seq = -(-query_lens // bq)  # [S]
    first_tile = jnp.cumsum(tiles_per_seq) - tiles_per_seq  # [S] exclusive prefix sum
    total_tiles = jnp.sum(tiles_per_seq)
    tile = jnp.arange(layout.num_tiles, dtype=jnp.int32)  # [N]
    # the last sequence whose first tile is <= tile (sequences without tiles share their
    # first tile with the next one and are passed over). One fused compare of [N, S]: the
    # default binary search is a loop, a launch and a host round trip per step on a GPU.
    seq = jnp.searchsorted(first_tile, tile, side="right",
                           method="compare_all").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, seq_lens.shape[0] - 1)
    live_tile = tile < total_tiles  # [N]
    tile_in_seq = tile - first_tile[seq]  # [N]
    q_len, s_len = query_lens[seq], seq_lens[seq]  # [N]
    row = jnp.arange(layout.rows, dtype=jnp.int32)  # [R]
    token_in_seq = tile_in_seq[:, None] * bq + row[None, :] // group  # [N, R] query index
    live_row = (live_tile[:, None] & (row[None, :] < bq * group)
                & (token_in_seq < q_len[:, None]))
    row_pos = jnp.where(live_row, (s_len - q_len)[:, None] + token_in_seq, -1)
    row_token = jnp.where(live_row, query_start_loc[seq][:, None] + token_in_seq, num_tokens)
    tile_kv_len = jnp.max(row_pos, axis=1) + 1  # [N]; 0 for empty tiles
    tile_seq = jnp.where(live_tile, seq, 0)
    return Tiles(tile_seq=tile_seq.astype(jnp.int32), tile_kv_len=tile_kv_len.astype(jnp.int32),
                 row_pos=row_pos.astype(jnp.int32), row_token=row_token.astype(jnp.int32))


def first_pages(row_pos: jax.Array, block_size: int, sliding_window: int | None) -> jax.Array:
    """[N] the first page (block-table column) each tile reads: the page of the first key
    its earliest query sees (row_pos [N, R], -1 for rows no query fills). 0 without a window
    and for empty tiles. Pages before it may name any block (a sliding layer's pool frees
    them): the kernels neither read nor copy them, so a long sequence costs its window."""
    if sliding_window is None:
        return jnp.zeros(row_pos.shape[0], jnp.int32)
    no_query = jnp.iinfo(jnp.int32).max
    earliest = jnp.min(jnp.where(row_pos >= 0, row_pos, no_query), axis=1)  # [N]
    first = score_mods.first_key(earliest, sliding_window) // block_size
    return jnp.where(earliest < no_query, first, 0).astype(jnp.int32)


def gather_queries(q: jax.Array, tiles: Tiles, layout: TileLayout, head_dim: int) -> jax.Array:
    """[T, H, D] queries -> [num_tiles, K, rows, head_dim] tiles (zeros where no query;
    lanes past D zero-padded up to `head_dim`)."""
    num_tokens, num_heads, dim = q.shape
    group = layout.group
    num_kv_heads = num_heads // group
    q4 = q.reshape(num_tokens, num_kv_heads, group, dim)
    head_in_group = jnp.arange(layout.rows, dtype=jnp.int32) % group  # [R]
    # [N, R] tokens x [R] heads -> [N, R, K, D]
    tiles_q = q4.at[tiles.row_token, :, head_in_group[None, :]].get(mode="fill", fill_value=0)
    tiles_q = tiles_q.transpose(0, 2, 1, 3)  # [N, K, R, D]
    if head_dim != dim:
        tiles_q = jnp.pad(tiles_q, ((0, 0), (0, 0), (0, 0), (0, head_dim - dim)))
    return tiles_q


def scatter_outputs(out_tiles: jax.Array, tiles: Tiles, layout: TileLayout, num_tokens: int,
                    head_dim: int, dtype) -> jax.Array:
    """[num_tiles, K, rows, >= head_dim] tile outputs -> [T, H, head_dim] in `dtype`; rows
    of tokens no tile holds (padding) are zero."""
    num_tiles, num_kv_heads, rows, _ = out_tiles.shape
    group = layout.group
    head_in_group = jnp.arange(rows, dtype=jnp.int32) % group
    values = out_tiles[..., :head_dim].transpose(0, 2, 1, 3).astype(dtype)  # [N, R, K, D]
    out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), dtype)
    out = out.at[tiles.row_token, :, head_in_group[None, :]].set(values, mode="drop")
    return out.reshape(num_tokens, num_kv_heads * group, head_dim)
