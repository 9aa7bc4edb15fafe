"""How many KV blocks the device pools and the host pool hold: from the engine's config and what
one block costs (`ModelRunner` measures the block; these functions only divide budgets)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxpage.engine.kv_groups import window_blocks_per_seq, window_host_blocks

if TYPE_CHECKING:
    from jaxpage.config import EngineConfig

# Default KV pool on CPU (and where the device reports no memory limit): 1 GiB.
CPU_KV_BUDGET = 1 << 30


def pool_blocks(config: EngineConfig, full_block: int, window_block: int, window: int | None,
                max_model_len: int, device: Any) -> tuple[int, int]:
    """(blocks of the full group, blocks of the window group: 0 without sliding layers).

    `num_blocks` / `num_window_blocks` as given, else from a byte budget per device
    (`kv_cache_memory`, or `gpu_memory_utilization` of the accelerator memory left after the
    params, or 1 GiB on CPU) over what one block of a group costs a device over its layers
    (`full_block`, `window_block` bytes). The window group takes what `max_num_seqs`
    sequences' windows hold at most (`window_blocks_per_seq`), but no more than its layers'
    share of the budget (what it would hold without paging windows); the full group the
    rest. A model with no full-attention layer still numbers full-group blocks (the prefix
    cache's bookkeeping, no memory): enough for `max_num_seqs` whole sequences."""
    budget = config.kv_cache_memory
    if budget is None:
        budget = CPU_KV_BUDGET
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            budget = int(free * config.gpu_memory_utilization)
    num_window = 0
    if window is not None:
        bs = config.block_size
        per_seq = window_blocks_per_seq(window, bs, config.max_num_batched_tokens,
                                        max_model_len)
        num_window = config.num_window_blocks
        if num_window is None:
            share = budget * window_block // (window_block + full_block) // window_block
            num_window = max(min(config.max_num_seqs * per_seq + 1, share), per_seq + 1)
        if not full_block:
            return config.max_num_seqs * -(-max_model_len // bs) + 1, num_window
        budget -= num_window * window_block
    if config.num_blocks is not None:
        return config.num_blocks, num_window
    num_blocks = budget // full_block
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory {budget} bytes holds {num_blocks} blocks of "
                         f"{full_block} bytes; need at least 2")
    return int(num_blocks), num_window


def num_host_blocks(config: EngineConfig, per_block: int, window_block: int = 0,
                    num_blocks: int = 0, num_window_blocks: int = 0) -> int:
    """The full group's host pool blocks (0: no host pool): `swap_space` bytes over one
    block's bytes; with a window group (`window_block` bytes a block, device pools of
    `num_blocks` and `num_window_blocks`), the most whose window group's share
    (`window_host_blocks`) fits beside them. A model with no full-attention layer
    (`per_block` 0) numbers full-group host blocks for the bookkeeping alone."""
    space = config.swap_space
    if not space:
        return 0

    def cost(n: int) -> int:
        return n * per_block + window_host_blocks(n, num_blocks, num_window_blocks) * window_block

    smallest = cost(1) if window_block else per_block
    if space < smallest:
        raise ValueError(f"swap_space {space} bytes is smaller than one KV block "
                         f"({smallest} bytes{' over both groups' if window_block else ''}); "
                         "use 0 (no host pool) or at least one block")
    if not window_block:
        return space // per_block
    low, high = 1, 2  # cost(low) <= space < cost(high)
    while cost(high) <= space:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cost(mid) <= space else (low, mid)
    return low
