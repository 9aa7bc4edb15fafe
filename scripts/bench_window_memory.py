"""KV bytes per token and the longest context a budget holds, sliding windows paged or not.

With sliding-window layers paged as such (jaxpage.engine.kv_groups) and without, for
Gemma-2-2B and Gemma-3-4B shapes.

Two numbers per model, each computed twice:

* arithmetic, from the config: without paging windows, every layer keeps every token
  (bytes/token = 2 (K, V) x layers x kv_heads x head_dim x dtype bytes, context = budget /
  that); with it, the window group is sized by the engine's rule for `max_num_seqs` = 1
  (`window_blocks_per_seq` blocks of the sliding layers) and the full-attention layers get
  the rest;
* checked against the allocator on abstract shapes: the engine's own pool sizing
  (`kv_sizing.pool_blocks`, no arrays allocated) gives both groups' block counts, and one
  sequence is grown chunk by chunk through a `WindowedAllocator` (and, for the unpaged
  number, a `BlockAllocator` over all layers) until the pool refuses a chunk.

    python scripts/bench_window_memory.py               # 1 GiB, bfloat16, chunks of 512
    python scripts/bench_window_memory.py --budget-gib 4 --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.attention import kv_bytes_per_block
from jaxpage.config import EngineConfig
from jaxpage.engine.block_allocator import BlockAllocator
from jaxpage.engine.kv_groups import WindowedAllocator, window_blocks_per_seq
from jaxpage.engine.kv_sizing import pool_blocks
from jaxpage.models.config import ModelConfig, layer_windows

# HF configs' shapes (google/gemma-2-2b, google/gemma-3-4b-pt text config)
SHAPES = {
    "Gemma-2-2B": dict(architecture="Gemma2ForCausalLM", vocab_size=256000, hidden_size=2304,
                       intermediate_size=9216, num_layers=26, num_heads=8, num_kv_heads=4,
                       head_dim=256, max_position_embeddings=8192, sliding_window=4096,
                       layer_types=tuple("sliding_attention" if (i + 1) % 2 else
                                         "full_attention" for i in range(26))),
    "Gemma-3-4B": dict(architecture="Gemma3ForCausalLM", vocab_size=262208, hidden_size=2560,
                       intermediate_size=10240, num_layers=34, num_heads=8, num_kv_heads=4,
                       head_dim=256, max_position_embeddings=131072, sliding_window=1024,
                       layer_types=tuple("sliding_attention" if (i + 1) % 6 else
                                         "full_attention" for i in range(34))),
}


@dataclasses.dataclass
class Row:
    name: str
    full_layers: int
    sliding_layers: int
    window: int
    bytes_per_token_unpaged: int
    bytes_per_token_full: int  # every token, full-attention layers
    bytes_per_token_sliding: int  # only tokens in the window, sliding layers
    context_unpaged: int  # arithmetic
    context_paged: int  # arithmetic
    allocator_unpaged: int  # tokens one sequence reached through the allocator
    allocator_paged: int
    num_blocks: int
    num_window_blocks: int


def grow_until_refused(alloc, chunk: int, block_size: int, limit: int) -> int:
    """Tokens one sequence reaches before the pool refuses: `chunk` tokens a step, then a
    block a step once a whole chunk no longer fits."""
    computed = 0
    if not alloc.allocate("s", min(chunk, limit)):
        return 0
    alloc.commit("s", range(min(chunk, limit)))
    computed = min(chunk, limit)
    for step in (chunk, block_size):
        while computed < limit and alloc.grow("s", min(computed + step, limit)) is not None:
            computed = min(computed + step, limit)
            alloc.commit("s", range(computed))
    return computed


def measure(name: str, fields: dict, budget: int, dtype, block_size: int, chunk: int) -> Row:
    config = ModelConfig(**fields)
    windows = layer_windows(config)
    full = sum(1 for w in windows if w is None)
    sliding = len(windows) - full
    window = config.sliding_window
    per_block = kv_bytes_per_block(config.num_layers, block_size, config.num_kv_heads,
                                   config.head_dim, dtype)
    full_block = kv_bytes_per_block(full, block_size, config.num_kv_heads, config.head_dim,
                                    dtype)
    window_block = kv_bytes_per_block(sliding, block_size, config.num_kv_heads,
                                      config.head_dim, dtype)
    long_limit = 1 << 24  # far past any pool: the pool, not the model, ends the sequence
    engine = EngineConfig(kv_cache_memory=budget, block_size=block_size, max_num_seqs=1,
                          max_num_batched_tokens=chunk)
    num_blocks, num_window = pool_blocks(engine, full_block, window_block, window, long_limit,
                                         jax.devices("cpu")[0])
    per_seq = window_blocks_per_seq(window, block_size, chunk, long_limit)
    assert num_window == per_seq + 1, (num_window, per_seq)
    unpaged_blocks = budget // per_block
    row = Row(
        name, full, sliding, window,
        bytes_per_token_unpaged=per_block // block_size,
        bytes_per_token_full=full_block // block_size,
        bytes_per_token_sliding=window_block // block_size,
        context_unpaged=(unpaged_blocks - 1) * block_size,
        context_paged=((budget - num_window * window_block) // full_block - 1) * block_size,
        allocator_unpaged=grow_until_refused(
            BlockAllocator(unpaged_blocks, block_size, enable_prefix_caching=False), chunk,
            block_size, long_limit),
        allocator_paged=grow_until_refused(
            WindowedAllocator(num_blocks, block_size, window=window,
                              num_window_blocks=num_window, enable_prefix_caching=False),
            chunk, block_size, long_limit),
        num_blocks=num_blocks, num_window_blocks=num_window)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    args = parser.parse_args()
    budget = int(args.budget_gib * (1 << 30))
    dtype = jnp.dtype(args.dtype)
    print(f"KV budget {args.budget_gib} GiB, {args.dtype}, block {args.block_size}, "
          f"prefill chunks of {args.chunk}, one sequence (max_num_seqs 1)\n")
    header = (f"{'model':<11} {'layers f/s':>10} {'window':>6} | {'B/token':>8} "
              f"{'context':>8} {'(alloc)':>8} | {'B/tok full':>10} {'B/tok win':>9} "
              f"{'context':>8} {'(alloc)':>8} | {'ratio':>5}")
    print(f"{'':<30} | {'without paging windows':^26} | {'with (window group)':^40} |")
    print(header)
    print("-" * len(header))
    for name, fields in SHAPES.items():
        r = measure(name, fields, budget, dtype, args.block_size, args.chunk)
        print(f"{r.name:<11} {f'{r.full_layers}/{r.sliding_layers}':>10} {r.window:>6} | "
              f"{r.bytes_per_token_unpaged:>8} {r.context_unpaged:>8} "
              f"{r.allocator_unpaged:>8} | {r.bytes_per_token_full:>10} "
              f"{r.bytes_per_token_sliding:>9} {r.context_paged:>8} {r.allocator_paged:>8} | "
              f"{r.context_paged / r.context_unpaged:>5.2f}")
        assert r.allocator_unpaged == r.context_unpaged, "allocator disagrees (unpaged)"
        assert r.allocator_paged == r.context_paged, "allocator disagrees (paged)"
    print("\ncontext: tokens of one sequence the pool holds (arithmetic); (alloc): tokens the "
          "allocator let one sequence reach (chunks, then blocks). A model's "
          "max_position_embeddings may end a sequence first (Gemma-2-2B: 8192).")


if __name__ == "__main__":
    main()
