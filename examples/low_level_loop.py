"""The paged KV cache without the engine: your own allocator calls and your own jitted loop.

For code that wants jaxpage's cache (a block pool, prefix sharing) but not its scheduler:
allocate the pool with `init_kv_pool`, manage block tables with `BlockAllocator`, pack each
step with `build_metadata`, and call any model's `forward(params, token_ids, positions,
kv_pool, metadata)` inside a jitted function. `greedy_generate` decodes a batch of prompts
greedily; `main()` runs it on a random-weight Llama.

    python examples/low_level_loop.py
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.engine.block_allocator import BlockAllocator


def _step(model, params, kv_pool, token_ids, positions, metadata):
    logits, kv_pool = model.forward(params, token_ids, positions, kv_pool, metadata)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_pool  # greedy: [R] next tokens


# The model object is static (hashable, compared by value), params are traced, and the pool is
# donated so XLA updates it in place instead of copying every layer each step.
STEP = jax.jit(_step, static_argnums=0, donate_argnums=2)


def greedy_generate(model: Any, params: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                    block_size: int = 16, *, kv_dtype: Any = jnp.float32,
                    stats: dict | None = None) -> list[list[int]]:
    """Greedy continuations (`max_tokens` ids each, EOS not special) of `prompts`.

    Prompts are prefilled one at a time, so a prompt that shares whole blocks with an earlier
    one reuses their cached K/V; then all sequences decode together, one token per step.
    Every call of a phase has the same shapes, so the loop compiles twice. If `stats` is a
    dict, the allocator's usage counters (incl. prefix-cache hits, in tokens) are put in it.
    """
    cfg = model.config
    longest = max(len(p) for p in prompts) + max_tokens
    width = -(-longest // block_size)  # block-table width: blocks of the longest sequence
    num_blocks = 1 + len(prompts) * width  # enough with no sharing at all; block 0 is padding
    kv_pool = init_kv_pool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                           cfg.head_dim, kv_dtype)
    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=True)
    tokens = [list(p) for p in prompts]
    prefill_len = 1 << (max(len(p) for p in prompts) - 1).bit_length()  # one padded shape

    # 1. Prefill, one prompt per call. lookup() finds the full blocks an earlier prompt
    #    already computed; allocate() takes them (ref count + 1) plus fresh blocks for the rest.
    for seq_id, prompt in enumerate(prompts):
        hit = allocator.lookup(prompt)
        if not allocator.allocate(seq_id, len(prompt), hit):
            raise RuntimeError("KV pool too small")  # cannot happen with the sizing above
        new = prompt[hit.num_tokens:]  # only the uncached tail is computed
        positions, metadata = build_metadata(
            [allocator.block_table(seq_id)], [hit.num_tokens], [len(new)], block_size,
            max_blocks_per_seq=width, num_tokens=prefill_len, max_query_len=prefill_len)
        token_ids = np.zeros(prefill_len, np.int32)
        token_ids[: len(new)] = new
        next_token, kv_pool = STEP(model, params, kv_pool, token_ids, positions, metadata)
        allocator.commit(seq_id, prompt)  # K/V of the prompt written: hash its full blocks
        tokens[seq_id].append(int(next_token[0]))

    # 2. Decode: each sequence feeds its last token; grow() adds a block when one fills up.
    seq_ids = range(len(prompts))
    for _ in range(max_tokens - 1):
        for seq_id in seq_ids:
            copies = allocator.grow(seq_id, len(tokens[seq_id]))
            # copy-on-write copies only arise for blocks shared by fork(); none here
            assert copies == [], copies
        positions, metadata = build_metadata(
            [allocator.block_table(s) for s in seq_ids],
            [len(tokens[s]) - 1 for s in seq_ids],  # tokens whose K/V is in the pool
            [1] * len(prompts), block_size, max_blocks_per_seq=width)
        token_ids = np.array([tokens[s][-1] for s in seq_ids], np.int32)
        next_tokens, kv_pool = STEP(model, params, kv_pool, token_ids, positions, metadata)
        for seq_id, token in zip(seq_ids, jax.device_get(next_tokens).tolist(), strict=True):
            allocator.commit(seq_id, tokens[seq_id])
            tokens[seq_id].append(token)

    if stats is not None:
        stats.update(allocator.usage())
    for seq_id in seq_ids:  # blocks go back to the pool; full ones stay cached (LRU)
        allocator.free(seq_id)
    return [t[len(p):] for t, p in zip(tokens, prompts, strict=True)]


def random_llama(seed: int = 0):
    """jaxpage's own LlamaModel, tiny, with random weights: (model, params)."""
    from jaxpage.models.config import ModelConfig
    from jaxpage.models.llama import LlamaModel, param_shapes

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=101, hidden_size=48,
                         intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=12, max_position_embeddings=256)
    key = iter(jax.random.split(jax.random.key(seed), 64))
    params = jax.tree.map(lambda shape: 0.2 * jax.random.normal(next(key), shape),
                          param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    return LlamaModel(config), params


def main() -> None:
    model, params = random_llama()
    shared = list(range(10, 30))  # one full 16-token block of common prefix, and 4 more
    prompts = [shared + [40, 41], [7, 8, 9], shared + [50, 51, 52, 53, 54]]
    stats: dict = {}
    outputs = greedy_generate(model, params, prompts, max_tokens=8, stats=stats)
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"prompt of {len(prompt)} tokens -> {out}")
    print(f"prefix-cache hits: {stats['prefix_cache_hits']} of "
          f"{stats['prefix_cache_queries']} prompt tokens")


if __name__ == "__main__":
    main()
