"""Paged decode attention on GPU: Pallas with the Triton lowering, flash-decoding split.

One program per (sequence, KV head, KV split). A program takes all query heads of its KV
head at once (the GQA group, zero-padded to >= 16 rows so the two products are `tl.dot`s),
walks its share of the sequence's pages through the block table, `pages_per_compute_block`
pages per step, and keeps an online softmax in registers. Each split writes its running
max, its sum of exponentials and its unnormalized output; the splits are combined in jnp
afterwards (`_combine_splits`), which is exact up to rounding.

The split is over the *actual* length of each sequence, not over the table width: split `j`
of a sequence of `n` pages covers pages `[j * c, (j + 1) * c)` with
`c = round_up(cdiv(n, num_splits), pages_per_compute_block)`, so short and long sequences in
one batch both spread over all splits, and a table wider than the batch needs costs nothing.

The oracle is `pallas_kernels.reference.paged_attention_reference` with one query per
sequence; tests/kernels/test_paged_decode_kernels.py holds the two to each other.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.checks import check_decode_inputs

# JAX 0.11 deprecated the Pallas Triton backend. In the sources read for 0.11 the warning is
# raised only when Triton is picked as the fallback backend (no compiler params); this module
# always passes `pltriton.CompilerParams`, but filter that one message in case a release warns
# on every Triton lowering. Nothing else is silenced.
TRITON_DEPRECATION_MESSAGE = r"The Pallas Triton backend is deprecated"
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION_MESSAGE, category=DeprecationWarning)

# Hopper-class defaults (H100/H200, 132 SMs), chosen on paper, not yet tuned on a GPU
# (scripts/bench_kernels.py --kernel-arg sweeps them). Decode is memory bound: a compute
# block of 128 tokens is a 32 KiB bf16 K tile plus as much V for head_dim 128, which two
# pipeline stages keep in flight within shared memory; 4 warps suffice for [16, 128] tiles.
DEFAULT_TOKENS_PER_COMPUTE_BLOCK = 128
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
# Enough programs for ~4 waves of 132 SMs; splits are only added while the batch has fewer.
TARGET_PROGRAMS = 4 * 132
MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


def _decode_kernel(
    q_ref,  # [group_rows, head_dim]: this sequence's query heads of one KV head
    k_ref,  # [num_blocks, block_size, head_dim]: this KV head's K pool
    v_ref,  # [num_blocks, block_size, head_dim]: this KV head's V pool
    table_ref,  # [table_width]: this sequence's block table (padded to whole compute blocks)
    length_ref,  # [1]: this sequence's length in tokens
    out_ref,  # [group_rows, head_dim] f32: this split's unnormalized output
    max_ref,  # [group_rows] f32: this split's running max of the scores (-inf if empty)
    sum_ref,  # [group_rows] f32: this split's sum of exp(score - max)
    *,
    scale: float,
    num_splits: int,
    pages_per_compute_block: int,
):
    group_rows, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    tokens = pages_per_compute_block * block_size
    split = pl.program_id(2)
    length = length_ref[0]

    # This split's pages: an equal share of the sequence's pages, in whole compute blocks.
    num_pages = pl.cdiv(length, block_size)
    pages_per_split = pl.cdiv(pl.cdiv(num_pages, num_splits), pages_per_compute_block)
    pages_per_split = pages_per_split * pages_per_compute_block
    first_page = split * pages_per_split
    end_page = jnp.minimum(first_page + pages_per_split, num_pages)
    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_compute_block)

    q = q_ref[...]  # [group_rows, head_dim]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def step(i, carry):
        acc, row_max, row_sum = carry  # [G, D], [G], [G]
        page = first_page + i * pages_per_compute_block
        page_ids = table_ref[pl.ds(page, pages_per_compute_block)]  # [P]
        # Pages wholly past the length are never read: their table entries may be anything.
        page_pos = page + jnp.arange(pages_per_compute_block, dtype=jnp.int32)  # [P]
        page_ids = jnp.where(page_pos < num_pages, page_ids, 0)
        k = k_ref[page_ids].reshape(tokens, head_dim)  # [P * B, D]
        v = v_ref[page_ids].reshape(tokens, head_dim)  # [P * B, D]
        token_pos = page * block_size + jnp.arange(tokens, dtype=jnp.int32)  # [T]
        valid = token_pos < length  # [T]; at least token 0 of every step is valid

        # [G, D] x [T, D] -> [G, T]; unowned slots may hold NaN: mask scores and values.
        scores = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=1))  # finite: a valid token per step
        correction = jnp.exp(row_max - new_max)  # 0 on the first step (row_max = -inf)
        probs = jnp.exp(scores - new_max[:, None])  # [G, T]
        row_sum = row_sum * correction + probs.sum(axis=1)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        # [G, T] x [T, D] -> [G, D]
        update = jax.lax.dot_general(
            probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
        return acc * correction[:, None] + update, new_max, row_sum

    init = (
        jnp.zeros((group_rows, head_dim), jnp.float32),
        jnp.full((group_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((group_rows,), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, num_steps, step, init)
    out_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def _build_decode_call(
    *,
    scale: float,
    num_seqs: int,
    num_kv_heads: int,
    group_rows: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    table_width: int,
    num_splits: int,
    pages_per_compute_block: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """The pallas_call over grid (sequence, KV head, split)."""
    kernel = functools.partial(
        _decode_kernel, scale=scale, num_splits=num_splits,
        pages_per_compute_block=pages_per_compute_block)
    split_shape = (num_seqs, num_kv_heads, num_splits, group_rows)
    return pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[
            # q [S, K, G, D]: the group of query heads of KV head h in sequence s
            pl.BlockSpec((None, None, group_rows, head_dim), lambda s, h, j: (s, h, 0, 0)),
            # k_pool [K, N, B, D]: all blocks of KV head h (pages are gathered in the body)
            pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda s, h, j: (h, 0, 0, 0)),
            # v_pool [K, N, B, D]: likewise
            pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda s, h, j: (h, 0, 0, 0)),
            # block_tables [S, W]: sequence s's row
            pl.BlockSpec((None, table_width), lambda s, h, j: (s, 0)),
            # seq_lens [S]: sequence s's length
            pl.BlockSpec((1,), lambda s, h, j: (s,)),
        ],
        out_specs=[
            # partial outputs [S, K, splits, G, D]: one [G, D] tile per program
            pl.BlockSpec((None, None, None, group_rows, head_dim),
                         lambda s, h, j: (s, h, j, 0, 0)),
            # running max [S, K, splits, G]
            pl.BlockSpec((None, None, None, group_rows), lambda s, h, j: (s, h, j, 0)),
            # sum of exponentials [S, K, splits, G]
            pl.BlockSpec((None, None, None, group_rows), lambda s, h, j: (s, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )


def _combine_splits(partial_out, split_max, split_sum):
    """Merge the splits' online-softmax states.

    partial_out [S, K, splits, G, D], split_max and split_sum [S, K, splits, G] -> [S, K, G, D].
    """
    total_max = split_max.max(axis=2, keepdims=True)  # [S, K, 1, G]
    total_max = jnp.where(jnp.isfinite(total_max), total_max, 0.0)  # all splits empty
    weight = jnp.exp(split_max - total_max)  # [S, K, splits, G]; empty splits weigh 0
    total_sum = (split_sum * weight).sum(axis=2)  # [S, K, G]
    out = (partial_out * weight[..., None]).sum(axis=2)  # [S, K, G, D]
    return out / jnp.where(total_sum > 0, total_sum, 1.0)[..., None]


def default_num_splits(num_seqs: int, num_kv_heads: int, max_compute_blocks: int) -> int:
    """Splits per sequence so that the grid has about `TARGET_PROGRAMS` programs."""
    wanted = -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_compute_blocks))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "pages_per_compute_block", "num_splits", "num_warps", "num_stages", "interpret",
    ),
)
def paged_decode_attention_gpu(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention (one query per sequence) over a paged KV pool, on GPU.

    Args:
      q: [S, num_heads, head_dim] float32 or bfloat16, one query per sequence. Query head h
        reads KV head h // (num_heads // num_kv_heads).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim], q's dtype. Slots
        that no sequence owns may hold anything, NaN included.
      block_tables: [S, max_blocks_per_seq] int32 block ids in [0, num_blocks); entries past
        a sequence's length are never read.
      seq_lens: [S] int32 tokens of each sequence, this step's token included; 0 marks a
        padding row, whose output is zeros.
      scale: softmax scale, default head_dim ** -0.5.
      pages_per_compute_block: pages per inner step (power of 2); default 128 tokens' worth.
      num_splits: KV splits per sequence (flash-decoding); default enough for ~4 waves of
        programs on a 132-SM GPU, capped by the compute blocks in the table width.
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      [S, num_heads, head_dim] in q's dtype.

    block_size and head_dim must be powers of 2 (Triton tiles); a head_dim that is not is
    zero-padded here, which copies the pools.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_pool.shape
    check_decode_inputs(q, k_pool, v_pool, block_tables, seq_lens)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of 2")
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, DEFAULT_TOKENS_PER_COMPUTE_BLOCK // block_size)
    if pages_per_compute_block < 1 or pages_per_compute_block & (pages_per_compute_block - 1):
        raise ValueError(
            f"pages_per_compute_block {pages_per_compute_block} must be a power of 2 >= 1")
    if pages_per_compute_block * block_size < 16:
        raise ValueError(
            f"pages_per_compute_block * block_size = {pages_per_compute_block * block_size}"
            " must be >= 16 (tl.dot)")
    table_width = block_tables.shape[1]
    max_compute_blocks = max(1, -(-table_width // pages_per_compute_block))
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_compute_blocks)
    if num_splits < 1:
        raise ValueError(f"num_splits {num_splits} must be >= 1")
    scale = head_dim**-0.5 if scale is None else scale

    group = num_heads // num_kv_heads
    group_rows = max(MIN_DOT_ROWS, _next_power_of_2(group))
    padded_dim = max(16, _next_power_of_2(head_dim))
    # [S, H, D] -> [S, K, G_pad, D_pad]; padded rows and lanes are zero
    q_grouped = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(
        q_grouped, ((0, 0), (0, 0), (0, group_rows - group), (0, padded_dim - head_dim)))
    if padded_dim != head_dim:  # copies the pools; pools sized to a power of 2 avoid it
        pad = ((0, 0), (0, 0), (0, 0), (0, padded_dim - head_dim))
        k_pool, v_pool = jnp.pad(k_pool, pad), jnp.pad(v_pool, pad)
    # whole compute blocks, so the last step's slice of the table stays in bounds
    padded_width = max_compute_blocks * pages_per_compute_block
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_width - table_width)))

    call = _build_decode_call(
        scale=scale, num_seqs=num_seqs, num_kv_heads=num_kv_heads, group_rows=group_rows,
        head_dim=padded_dim, num_blocks=num_blocks, block_size=block_size,
        table_width=padded_width, num_splits=num_splits,
        pages_per_compute_block=pages_per_compute_block, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret)
    partial_out, split_max, split_sum = call(q_grouped, k_pool, v_pool, tables, seq_lens)
    out = _combine_splits(partial_out, split_max, split_sum)  # [S, K, G_pad, D_pad]
    out = out[:, :, :group, :head_dim].reshape(num_seqs, num_heads, head_dim)
    return out.astype(q.dtype)


