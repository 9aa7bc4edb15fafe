"""Ragged paged attention on GPU: prefill chunks and decode tokens in one Pallas (Triton) call.

The batch is token-flat and ragged, as the engine packs a step (see `ragged_tiles`): each
sequence brings any number of new queries (decode: one; a prefill chunk: many), which attend
causally to everything cached before them and to the earlier queries of their own chunk.
`ragged_tiles` cuts the queries into tiles of `rows = tokens x GQA group` rows; one program
per (tile, KV head, KV split) multiplies its `[rows, D]` tile by `KEYS_PER_BLOCK` keys at a
time, gathered page by page through the sequence's block table where they lie in the pool,
with an online softmax in registers. A tile reads keys only up to its last query (the
causal bound); within that, the mask `key_pos <= row_pos` is exact per row.

Splits (flash-decoding) cut a tile's keys into equal shares in whole compute blocks, each
program writing its running max, sum and unnormalized output, merged afterwards in jnp
(`combine_splits`, exact up to rounding); they matter for long contexts with few tiles. The
split is over the keys a tile actually reads, not the table width, so short and long
sequences in one batch both spread over all splits. A pure decode step (`max_query_len` 1)
gets one-token tiles of >= 16 rows (`tl.dot`'s minimum); otherwise tiles of ~64 rows reuse
every K/V page for many queries. The same kernel serves `paged_decode_gpu`, whose tiles are
simply one per sequence.

The oracle is `pallas_kernels.reference.paged_attention_reference` (same signature);
tests/kernels/test_ragged_kernels.py holds the two, and a float64 NumPy oracle, to each other.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import quantized, ragged_tiles, score_mods
from pallas_kernels.checks import check_ragged_inputs

# JAX 0.11 deprecated the Pallas Triton backend. In the sources read for 0.11 the warning is
# raised only when Triton is picked as the fallback backend (no compiler params); these
# kernels always pass `pltriton.CompilerParams`, but filter that one message in case a
# release warns on every Triton lowering. Nothing else is silenced.
TRITON_DEPRECATION_MESSAGE = r"The Pallas Triton backend is deprecated"
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION_MESSAGE, category=DeprecationWarning)

MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
DECODE_ROWS = MIN_DOT_ROWS
PREFILL_ROWS = 64  # beat 32 and 128 (8 warps) on the H200 sweep
# Keys per inner step. On an H200 (docs/bench/h200_kernels_run2.log, --sweep) 128 keys beat
# 64, 32 and 256 on prefill and mixed steps (64-row tiles, 4 warps, 2 stages) and were within
# noise of 64 on decode: a 128-key step is a 32 KiB bf16 K tile plus as much V at head_dim
# 128, which two pipeline stages keep in flight in shared memory.
KEYS_PER_BLOCK = 128
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
# Enough programs for ~4 waves of an H200's 132 SMs; splits are only added while the grid
# has fewer.
TARGET_PROGRAMS = 4 * 132


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pool_head_dim(head_dim: int) -> int:
    """The head dim a pool must have for this kernel to read it without a copy: Triton tiles
    are powers of 2 (>= 16)."""
    return max(16, next_power_of_2(head_dim))


def _attention_kernel(
    q_ref,  # [rows, D]: this tile's queries of one KV head's group
    k_ref,  # [num_blocks, block_size, D]: this KV head's K pool (quantized: its values)
    v_ref,  # [num_blocks, block_size, D]: this KV head's V pool (quantized: its values)
    *refs,
    # quantized pools only: ks_ref, vs_ref [num_blocks, block_size] f32, this KV head's K
    # and V scales; then
    # table_ref [table_width]: the tile's sequence's block table (whole compute blocks)
    # kv_len_ref [1]: keys the tile reads (its last query's position + 1; 0 if empty)
    # first_page_ref [1]: the tile's first page (its earliest query's window start; else 0)
    # row_pos_ref [rows]: position of each row's query, -1 for empty rows
    # out_ref [rows, D] f32: this split's unnormalized output
    # max_ref [rows] f32: this split's running max (-inf where no key was seen)
    # sum_ref [rows] f32: this split's sum of exp(score - max)
    scale: float,
    num_splits: int,
    pages_per_compute_block: int,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized_pools: bool = False,
):
    scale_refs = refs[:2] if quantized_pools else None
    if quantized_pools:
        refs = refs[2:]
    table_ref, kv_len_ref, first_page_ref, row_pos_ref, out_ref, max_ref, sum_ref = refs
    rows, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    keys = pages_per_compute_block * block_size
    split = pl.program_id(2)
    kv_len = kv_len_ref[0]

    # This split's pages: an equal share of the tile's pages (from its first, past which a
    # sliding window sees nothing), in whole compute blocks.
    num_pages = pl.cdiv(kv_len, block_size)
    tile_first_page = first_page_ref[0]
    pages_per_split = pl.cdiv(pl.cdiv(num_pages - tile_first_page, num_splits),
                              pages_per_compute_block)
    pages_per_split = pages_per_split * pages_per_compute_block
    first_page = tile_first_page + split * pages_per_split
    end_page = jnp.minimum(first_page + pages_per_split, num_pages)
    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_compute_block)

    q = q_ref[...]  # [R, D]
    row_pos = row_pos_ref[...]  # [R]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def step(i, carry):
        acc, row_max, row_sum = carry  # [R, D], [R], [R]
        page = first_page + i * pages_per_compute_block
        page_ids = table_ref[pl.ds(page, pages_per_compute_block)]  # [P]
        # Pages wholly past the tile's keys are never read: their entries may be anything.
        page_pos = page + jnp.arange(pages_per_compute_block, dtype=jnp.int32)
        page_ids = jnp.where(page_pos < num_pages, page_ids, 0)
        k = k_ref[page_ids].reshape(keys, head_dim)  # [P * B, D]
        v = v_ref[page_ids].reshape(keys, head_dim)
        if quantized_pools:  # dequantized as loaded: float32(values) * scales, as
            # quantized.dequantize; the float32 math below is the float pools'
            ks_ref, vs_ref = scale_refs
            k = k.astype(jnp.float32) * ks_ref[page_ids].reshape(keys)[:, None]
            v = v.astype(jnp.float32) * vs_ref[page_ids].reshape(keys)[:, None]
        key_pos = page * block_size + jnp.arange(keys, dtype=jnp.int32)  # [Kb]

        # [R, D] x [Kb, D] -> [R, Kb]. Causal per row (and within its window); row_pos <
        # kv_len <= the sequence's length, so keys past it (unowned slots, maybe NaN) are
        # masked too.
        scores = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32) * scale
        scores = score_mods.soft_cap(scores, soft_cap)
        mask = score_mods.visible(key_pos[None, :], row_pos[:, None], sliding_window)
        scores = jnp.where(mask, scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        # a row may have seen no key yet (all masked so far): exponents against 0, not -inf
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        correction = jnp.exp(row_max - safe_max)  # 0 while row_max is -inf
        probs = jnp.exp(scores - safe_max[:, None])  # [R, Kb]; 0 where masked
        row_sum = row_sum * correction + probs.sum(axis=1)
        v = jnp.where((key_pos < kv_len)[:, None], v, jnp.zeros_like(v))  # 0 * NaN = NaN
        # [R, Kb] x [Kb, D] -> [R, D]
        update = jax.lax.dot_general(
            probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
        return acc * correction[:, None] + update, new_max, row_sum

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, num_steps, step, init)
    out_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def _build_call(*, scale, num_tiles, num_kv_heads, rows, head_dim, num_blocks, block_size,
                table_width, num_splits, pages_per_compute_block, num_warps, num_stages,
                sliding_window, soft_cap, interpret, name, quantized_pools=False):
    """The pallas_call over grid (tile, KV head, split): (q tiles [N, K, R, D], k_pool,
    v_pool, [k_scales, v_scales [K, NB, B] for quantized pools,] tile tables [N, W], tile
    kv lengths [N], tile first pages [N], row positions [N, R]) -> (partial outputs
    [N, K, splits, R, D], running maxes and sums [N, K, splits, R]), f32."""
    kernel = functools.partial(
        _attention_kernel, scale=scale, num_splits=num_splits,
        pages_per_compute_block=pages_per_compute_block, sliding_window=sliding_window,
        soft_cap=soft_cap, quantized_pools=quantized_pools)
    split_shape = (num_tiles, num_kv_heads, num_splits, rows)
    # scales [K, NB, B] f32: all blocks of KV head h, beside its values
    scale_specs = [pl.BlockSpec((None, num_blocks, block_size), lambda i, h, j: (h, 0, 0))
                   ] * (2 if quantized_pools else 0)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=[
            # q tiles [N, K, R, D]: tile i's rows of KV head h
            pl.BlockSpec((None, None, rows, head_dim), lambda i, h, j: (i, h, 0, 0)),
            # k_pool [K, NB, B, D]: all blocks of KV head h (pages are gathered in the body)
            pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda i, h, j: (h, 0, 0, 0)),
            pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda i, h, j: (h, 0, 0, 0)),
            *scale_specs,
            # tile tables [N, W]: the block table of tile i's sequence
            pl.BlockSpec((None, table_width), lambda i, h, j: (i, 0)),
            # tile kv lengths [N] and first pages [N]
            pl.BlockSpec((1,), lambda i, h, j: (i,)),
            pl.BlockSpec((1,), lambda i, h, j: (i,)),
            # row positions [N, R]
            pl.BlockSpec((None, rows), lambda i, h, j: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, j: (i, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )


def combine_splits(partial_out, split_max, split_sum):
    """Merge the splits' online-softmax states.

    partial_out [N, K, splits, R, D], split_max and split_sum [N, K, splits, R] -> [N, K, R, D].
    """
    total_max = split_max.max(axis=2, keepdims=True)  # [N, K, 1, R]
    total_max = jnp.where(jnp.isfinite(total_max), total_max, 0.0)  # all splits empty
    weight = jnp.exp(split_max - total_max)  # [N, K, splits, R]; empty splits weigh 0
    total_sum = (split_sum * weight).sum(axis=2)  # [N, K, R]
    out = (partial_out * weight[..., None]).sum(axis=2)  # [N, K, R, D]
    return out / jnp.where(total_sum > 0, total_sum, 1.0)[..., None]


def attend_tiles(q_tiles, k_pool, v_pool, tables, kv_lens, row_pos, *, scale,
                 pages_per_compute_block, num_splits, num_warps, num_stages, interpret,
                 name, sliding_window=None, soft_cap=None):
    """Run the kernel over prepared tiles and merge its splits.

    q_tiles [N, K, R, Dp] (Dp = pool_head_dim of the pool's head dim, lanes past the
    queries' zero), tables [N, W] the block table of each tile's sequence, kv_lens [N] the
    keys each tile reads, row_pos [N, R] each row's query position (-1: none) ->
    [N, K, R, Dp] f32 attention outputs. A pool whose head dim is not Dp is padded here
    (a copy; pools allocated at pool_head_dim avoid it). With a `sliding_window`, a tile
    reads pages from the one of its earliest query's first key on
    (`ragged_tiles.first_pages`). Quantized pools (`quantized.QuantizedPool`) are read
    as their dequantization, tile by tile inside the kernel; q_tiles must then be f32."""
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    _, num_blocks, block_size, pool_dim = k_pool.shape
    quantized_pools = quantized.is_quantized(k_pool)
    scales = (k_pool.scales, v_pool.scales) if quantized_pools else ()
    if quantized_pools:
        k_pool, v_pool = k_pool.values, v_pool.values
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of 2")
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, KEYS_PER_BLOCK // block_size)
    if pages_per_compute_block < 1 or pages_per_compute_block & (pages_per_compute_block - 1):
        raise ValueError(
            f"pages_per_compute_block {pages_per_compute_block} must be a power of 2 >= 1")
    if pages_per_compute_block * block_size < MIN_DOT_ROWS:
        raise ValueError(f"pages_per_compute_block * block_size = "
                         f"{pages_per_compute_block * block_size} must be >= {MIN_DOT_ROWS}")
    table_width = tables.shape[1]
    max_compute_blocks = max(1, -(-table_width // pages_per_compute_block))
    if num_splits is None:  # about TARGET_PROGRAMS programs
        wanted = -(-TARGET_PROGRAMS // max(1, num_tiles * num_kv_heads))
        num_splits = max(1, min(wanted, max_compute_blocks))
    if num_splits < 1:
        raise ValueError(f"num_splits {num_splits} must be >= 1")
    if pool_dim != head_dim:
        pad = ((0, 0), (0, 0), (0, 0), (0, head_dim - pool_dim))
        k_pool, v_pool = jnp.pad(k_pool, pad), jnp.pad(v_pool, pad)
    # whole compute blocks, so the last step's slice of a table stays in bounds (one more
    # where a window starts a tile's steps mid compute block)
    padded_width = (max_compute_blocks + (sliding_window is not None)) * pages_per_compute_block
    tables = jnp.pad(tables, ((0, 0), (0, padded_width - table_width)))
    first_pages = ragged_tiles.first_pages(row_pos, block_size, sliding_window)
    call = _build_call(
        scale=scale, num_tiles=num_tiles, num_kv_heads=num_kv_heads, rows=rows,
        head_dim=head_dim, num_blocks=num_blocks, block_size=block_size,
        table_width=padded_width, num_splits=num_splits,
        pages_per_compute_block=pages_per_compute_block, num_warps=num_warps,
        num_stages=num_stages, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=interpret, name=name, quantized_pools=quantized_pools)
    return combine_splits(*call(q_tiles, k_pool, v_pool, *scales, tables, kv_lens,
                                first_pages, row_pos))


@functools.partial(
    jax.jit,
    static_argnames=("max_query_len", "scale", "query_rows", "pages_per_compute_block",
                     "num_splits", "num_warps", "num_stages", "interpret", "sliding_window",
                     "soft_cap"),
)
def ragged_paged_attention_gpu(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    query_rows: int = PREFILL_ROWS,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of a ragged batch of queries over a paged KV pool, on GPU.

    Args:
      q: [T, num_heads, head_dim] float32 or bfloat16 (already rotated). Query head h reads
        KV head h // (num_heads // num_kv_heads).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, pool_head_dim], q's dtype, this
        step's K/V already written. pool_head_dim >= head_dim: a pool allocated at
        `pool_head_dim(head_dim)` (zeros past head_dim) is read in place; any other is padded
        here, which copies it. Or both `quantized.QuantizedPool`s of one format (values
        padded as a float pool would be; read as their dequantization, each page
        dequantized in the kernel as it is loaded; q is then attended in float32). Slots
        no sequence owns may hold anything, NaN included (a NaN scale too).
      block_tables: [S, W] int32; entries past a sequence's length are never read.
      seq_lens: [S] int32 tokens of each sequence including this step's (0: padding).
      query_start_loc: [S + 1] int32 offsets of each sequence's queries in q; tokens past
        query_start_loc[S] are padding.
      max_query_len: static bound on queries per sequence (1: a pure decode step).
      scale: softmax scale, default head_dim ** -0.5.
      query_rows: rows of a tile when max_query_len > 1 (queries x GQA group; a power of 2).
      pages_per_compute_block: pages per inner step (power of 2); default 128 keys' worth.
      num_splits: KV splits per tile; default enough for ~4 waves of programs on 132 SMs.
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas interpret mode (CPU).
      sliding_window: a query at p sees only the keys (p - sliding_window, p]; a tile
        reads no page before its earliest query's window, and those pages' table entries
        may name any block.
      soft_cap: scores -> soft_cap * tanh(scores / soft_cap) (Gemma 2), before masking.

    Returns:
      [T, num_heads, head_dim] in q's dtype; rows of padding tokens are zero.
    """
    check_ragged_inputs(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc,
                        max_query_len)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, _, pool_dim = k_pool.shape
    num_seqs = block_tables.shape[0]
    scale = head_dim**-0.5 if scale is None else scale
    padded_dim = pool_head_dim(pool_dim)
    group = num_heads // num_kv_heads
    layout = ragged_tiles.tile_layout(
        num_tokens, num_seqs, group, max_query_len, decode_rows=DECODE_ROWS,
        prefill_rows=query_rows, round_rows=next_power_of_2)
    tiles = ragged_tiles.make_tiles(layout, seq_lens, query_start_loc, num_tokens)
    # quantized pools are read in float32 (their dequantization), whatever q's dtype
    q_attend = q.astype(jnp.float32) if quantized.is_quantized(k_pool) else q
    q_tiles = ragged_tiles.gather_queries(q_attend, tiles, layout, padded_dim)  # [N, K, R, Dp]
    out = attend_tiles(
        q_tiles, k_pool, v_pool, block_tables[tiles.tile_seq], tiles.tile_kv_len,
        tiles.row_pos, scale=scale, pages_per_compute_block=pages_per_compute_block,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, name="ragged_paged_attention_gpu", sliding_window=sliding_window,
        soft_cap=soft_cap)  # [N, K, R, Dp]
    return ragged_tiles.scatter_outputs(out, tiles, layout, num_tokens, head_dim, q.dtype)
