"""KV cache groups: the layers with a sliding window keep their K/V in a pool of their own, and
a sequence's blocks leave that pool as they leave its window (plain Python, no JAX).

A model whose layers all attend to every earlier token has one group. One with sliding-window
layers (Gemma 2's alternate layers, Gemma 3's five of six, every layer of Mistral) has two:

* the full group: the full-attention layers' pool, addressed through the sequence's block
  table, managed by the ``TieredAllocator`` as for any model (prefix cache, ref counts,
  copy-on-write; a model with no full-attention layer still keeps this bookkeeping, with no
  pool behind it);
* the window group (``WindowGroup``): the sliding layers' pool, a second free list of its own
  block ids. A sequence's *window table* runs parallel to its block table (entry ``i`` holds
  positions ``[i * block_size, (i + 1) * block_size)`` in both), but with ``window`` W, once
  ``n`` tokens are computed the next queries (positions >= n) read keys from position
  ``n - W + 1`` on, so every entry before ``first_needed(n) = max(0, (n - W + 1) // block_size)``
  is released and set to the null block 0. A sequence holds at most
  ``window_blocks_per_seq`` window blocks, however long it grows.

Why two pools and not vLLM's hybrid allocator (one free list whose block ids address every
group, each layer's tensor shared by one layer of each group): that needs groups with equal
numbers of layers (Gemma 3's 5:1 pattern over 34 layers does not divide; vLLM pads) and a
tensor shared between layers, which the model protocol's per-layer donated pool cannot
express. The price of two pools is a split of memory fixed at start-up (see
``jaxpage.engine.runner``): the window group is sized for ``max_num_seqs`` sequences' windows,
and the full group gets the rest.

Prefix caching: the window group hashes nothing itself. A window block that becomes full is
keyed with the full group's key of the same block (same tokens, same chain), so a released
window block stays findable (cached-free, LRU) until its id is handed out again. A prefix hit
of ``k`` blocks needs the full group's ``k`` blocks and the window group's blocks
``[first_needed(k * block_size), k)``; ``lookup`` takes the longest ``k`` for which both hold,
so a hit never reuses a window block that was released and overwritten.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from jaxpage.engine.block_allocator import NULL_BLOCK, AllocationError, PrefixHit
from jaxpage.engine.block_hashing import _EXTRA, _HASH, _PARENT, _TOKENS, _BlockKey, match_block
from jaxpage.engine.tiered_allocator import TieredAllocator


def window_blocks_per_seq(window: int, block_size: int, max_chunk: int, max_model_len: int) -> int:
    """Most window blocks one sequence holds at once: during a step computing up to
    `max_chunk` tokens after `n` computed ones, the blocks from position n - window + 1 to
    n + max_chunk - 1 (capped by the blocks of a whole `max_model_len` sequence)."""
    span = -(-(window - 1 + max_chunk) // block_size) + 1
    return min(span, -(-max_model_len // block_size))


@dataclass(slots=True)
class _WindowSeq:
    table: list[int]  # NULL_BLOCK where the block left the window
    num_computed_tokens: int


class WindowGroup:
    """The window group's blocks: ref counts, a FIFO of never-keyed free blocks, an LRU of
    released blocks still holding a keyed (full) block's content, and each sequence's window
    table. Allocation order and ownership rules are the ``BlockAllocator``'s (see its module
    docstring); copy-on-write applies to forked sequences' shared blocks the same way."""

    def __init__(self, num_blocks: int, block_size: int, window: int, *,
                 track_released: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_window_blocks must be >= 2 (block 0 is reserved), "
                             f"got {num_blocks}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self._ref_count = [0] * num_blocks
        self._key: list[_BlockKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_blocks: dict[bytes, dict[int, None]] = {}
        self._seqs: dict[Hashable, _WindowSeq] = {}
        self._released: list[int] | None = [] if track_released else None

    def first_needed(self, num_computed: int) -> int:
        """Index of the first block the next queries of a sequence with `num_computed`
        tokens read (they see keys from position num_computed - window + 1 on)."""
        return max(0, (num_computed - self.window + 1) // self.block_size)

    # ---------------------------------------------------------------- prefix hits

    def lookup(self, hashes: Sequence[bytes], keys: Sequence[_BlockKey]) -> tuple[int, list[int]]:
        """The longest hit, ``(k, window block ids)``, a full-group hit of ``len(hashes)``
        blocks (their hashes and keys) can keep: the window group must hold blocks
        ``[first_needed(k * block_size), k)``. Scans down from the top: a miss at level j
        rules out every hit longer than j that needs it."""
        k = len(hashes)
        while k > 0:
            ids = []
            for j in range(self.first_needed(k * self.block_size), k):
                block_id = self._find(hashes[j], keys[j])
                if block_id is None:
                    k = j
                    break
                ids.append(block_id)
            else:
                return k, ids
        return 0, []

    def _find(self, block_hash: bytes, key: _BlockKey) -> int | None:
        bucket = self._hash_to_blocks.get(block_hash)
        if not bucket:
            return None
        return match_block(bucket, self._key, key[_TOKENS], key[_EXTRA], key[_PARENT])

    # ---------------------------------------------------------------- allocation

    def _fresh_needed(self, num_tokens: int, num_hit: int, hit_ids: Sequence[int]) -> int:
        """Fresh blocks ``allocate`` takes, after checking the hit's blocks are current."""
        for block_id in hit_ids:
            if not (0 < block_id < self.num_blocks) or self._key[block_id] is None:
                raise AllocationError(f"stale prefix hit: window block {block_id} no longer "
                                      "holds the hashed content; lookup right before allocate")
        return -(-num_tokens // self.block_size) - num_hit

    def can_allocate(self, num_tokens: int, num_hit: int, hit_ids: Sequence[int]) -> bool:
        hit_free = sum(1 for b in hit_ids if self._ref_count[b] == 0)
        return self._fresh_needed(num_tokens, num_hit, hit_ids) <= (
            self.num_free_blocks - hit_free)

    def allocate(self, seq_id: Hashable, num_tokens: int, num_hit: int,
                 hit_ids: Sequence[int]) -> None:
        """Register a sequence (``can_allocate`` said yes): the hit's window blocks, null
        entries before them, fresh blocks for the rest of ``num_tokens``."""
        need = self._fresh_needed(num_tokens, num_hit, hit_ids)
        for block_id in hit_ids:
            if self._ref_count[block_id] == 0:
                del self._cached_free[block_id]
            self._ref_count[block_id] += 1
        table = [NULL_BLOCK] * (num_hit - len(hit_ids)) + list(hit_ids)
        table += [self._take_free_block() for _ in range(need)]
        self._seqs[seq_id] = _WindowSeq(table, num_hit * self.block_size)

    def _grow_plan(self, seq: _WindowSeq, num_tokens: int) -> tuple[list[int], int]:
        """(indices to copy on write, blocks to append) for ``grow``."""
        table, computed = seq.table, seq.num_computed_tokens
        end = -(-num_tokens // self.block_size)
        cow = []
        if num_tokens > computed:  # every index from computed's block on is in the window
            cow = [i for i in range(computed // self.block_size, min(end, len(table)))
                   if self._ref_count[table[i]] > 1]
        return cow, max(0, end - len(table))

    def can_grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        cow, append = self._grow_plan(self._seq(seq_id), num_tokens)
        return len(cow) + append <= self.num_free_blocks

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]]:
        """Cover ``num_tokens`` tokens, owning every block the step writes (``can_grow``
        said yes); returns the ``(src, dst)`` copy-on-write copies."""
        seq = self._seq(seq_id)
        cow, append = self._grow_plan(seq, num_tokens)
        copies = []
        for i in cow:
            src, dst = seq.table[i], self._take_free_block()
            self._ref_count[src] -= 1
            seq.table[i] = dst
            if seq.num_computed_tokens > i * self.block_size:
                copies.append((src, dst))
        seq.table.extend(self._take_free_block() for _ in range(append))
        return copies

    def commit(self, seq_id: Hashable, num_tokens: int,
               full_key: Callable[[int], _BlockKey | None]) -> None:
        """``num_tokens`` are computed: key the blocks that became full with the full
        group's keys (``full_key(index)``, None with prefix caching off), then release the
        blocks that left the window."""
        seq = self._seq(seq_id)
        old, bs = seq.num_computed_tokens, self.block_size
        for i in range(old // bs, num_tokens // bs):
            key = full_key(i)
            block_id = seq.table[i]
            if key is not None and self._key[block_id] is None:
                self._key[block_id] = key
                self._hash_to_blocks.setdefault(key[_HASH], {})[block_id] = None
        seq.num_computed_tokens = num_tokens
        for i in range(self.first_needed(old), self.first_needed(num_tokens)):
            self._release(seq.table[i])
            seq.table[i] = NULL_BLOCK

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        parent = self._seq(parent_id)
        for block_id in parent.table:
            if block_id != NULL_BLOCK:
                self._ref_count[block_id] += 1
        self._seqs[child_id] = _WindowSeq(list(parent.table), parent.num_computed_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; its blocks are released tail first."""
        seq = self._seqs.pop(seq_id)
        for block_id in reversed(seq.table):
            if block_id != NULL_BLOCK:
                self._release(block_id)

    def trim(self, seq_id: Hashable, num_blocks: int) -> None:
        """Keep the first ``num_blocks`` entries of the window table (``BlockAllocator.trim``
        for the window group)."""
        table = self._seq(seq_id).table
        while len(table) > num_blocks:
            block_id = table.pop()
            if block_id != NULL_BLOCK:
                self._release(block_id)

    def _release(self, block_id: int) -> None:
        self._ref_count[block_id] -= 1
        if self._ref_count[block_id]:
            return
        if self._key[block_id] is None:
            self._free.append(block_id)
            if self._released is not None:
                self._released.append(block_id)
        else:
            self._cached_free[block_id] = None

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            self._forget(block_id)
        self._ref_count[block_id] = 1
        if self._released is not None:
            self._released.append(block_id)
        return block_id

    def _forget(self, block_id: int) -> None:
        key = self._key[block_id]
        bucket = self._hash_to_blocks[key[_HASH]]
        del bucket[block_id]
        if not bucket:
            del self._hash_to_blocks[key[_HASH]]
        self._key[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block_id in list(self._cached_free):
            self._forget(block_id)
            self._free.append(block_id)
            if self._released is not None:
                self._released.append(block_id)
        self._cached_free.clear()
        return True

    # ---------------------------------------------------------------- queries

    def _seq(self, seq_id: Hashable) -> _WindowSeq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise AllocationError(f"unknown seq_id {seq_id!r} in the window group") from None

    def table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's window table (null where blocks left the window)."""
        return list(self._seq(seq_id).table)

    def num_held(self, seq_id: Hashable) -> int:
        """Window blocks the sequence holds."""
        return sum(1 for b in self._seq(seq_id).table if b != NULL_BLOCK)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    def take_released(self) -> list[int]:
        if not self._released:
            return []
        released, self._released = list(dict.fromkeys(self._released)), []
        return released

    def usage(self) -> dict[str, float | int]:
        usable, free, cached = self.num_blocks - 1, len(self._free), len(self._cached_free)
        used = usable - free - cached
        return {"window_num_blocks": usable, "window_used": used, "window_cached_free": cached,
                "window_free": free, "window_usage": used / usable}

    def check_invariants(self) -> None:
        """Ref counts equal live table entries; free structures partition the unused blocks;
        every table holds exactly the blocks from its first needed one on; keyed blocks are
        mapped by their hash."""
        bs, counts = self.block_size, [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            first = self.first_needed(seq.num_computed_tokens)
            held = [b for b in seq.table if b != NULL_BLOCK]
            assert seq.table[:first] == [NULL_BLOCK] * first, (
                f"window seq {seq_id!r} holds blocks before index {first}: {seq.table}")
            assert NULL_BLOCK not in seq.table[first:], f"window seq {seq_id!r}: {seq.table}"
            assert len(set(held)) == len(held), f"window seq {seq_id!r}: duplicate block"
            assert seq.num_computed_tokens <= len(seq.table) * bs
            for block_id in held:
                counts[block_id] += 1
        assert self._ref_count == counts, "window group ref counts != live table entries"
        free, cached = set(self._free), set(self._cached_free)
        assert len(free) == len(self._free) and not free & cached
        assert all(counts[b] == 0 and self._key[b] is None for b in free)
        assert all(counts[b] == 0 and self._key[b] is not None for b in cached)
        in_use = sum(1 for c in counts if c)
        assert len(free) + len(cached) + in_use == self.num_blocks - 1, "window conservation"
        mapped = {b for bucket in self._hash_to_blocks.values() for b in bucket}
        assert mapped == {b for b, key in enumerate(self._key) if key is not None}


class WindowedAllocator(TieredAllocator):
    """The allocator of a model with sliding-window layers: the ``TieredAllocator`` for the
    full group plus a ``WindowGroup`` moved in lockstep (module docstring). Every operation
    is all-or-nothing over both groups. No host tier: swapping a sequence's two groups out
    and back is not built, so such models preempt by recompute."""

    def __init__(self, num_blocks: int, block_size: int, *, window: int, num_window_blocks: int,
                 track_released: bool = False, **kwargs) -> None:
        if kwargs.get("num_host_blocks"):
            raise ValueError("a host pool (swap_space > 0) is not supported with "
                             "sliding-window layers; use swap_space=0")
        super().__init__(num_blocks, block_size, track_released=track_released, **kwargs)
        self.window_group = WindowGroup(num_window_blocks, block_size, window,
                                        track_released=track_released)
        self._window_copies: list[tuple[int, int]] = []

    def lookup(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
               adapter_id: str | int | None = None) -> PrefixHit:
        """The full group's hit, cut to the longest prefix whose window blocks the window
        group still holds."""
        hit = super().lookup(token_ids, cache_salt=cache_salt, adapter_id=adapter_id)
        keys = [self._block_key[b] for b in hit.block_ids]
        k, window_ids = self.window_group.lookup(hit.block_hashes, keys)
        return PrefixHit(hit.block_ids[:k], hit.block_hashes[:k], k * self.block_size,
                         cache_salt, adapter_id, window_block_ids=tuple(window_ids))

    def allocate(self, seq_id: Hashable, num_tokens: int, hit: PrefixHit | None = None, *,
                 final_num_tokens: int | None = None, cache_salt: str | None = None,
                 adapter_id: str | int | None = None) -> bool:
        num_hit = len(hit.block_ids) if hit is not None else 0
        window_ids = hit.window_block_ids if hit is not None else ()
        if seq_id in self._seqs:
            raise AllocationError(f"seq_id {seq_id!r} is already allocated")
        if not self.window_group.can_allocate(num_tokens, num_hit, window_ids):
            return False
        if not super().allocate(seq_id, num_tokens, hit, final_num_tokens=final_num_tokens,
                                cache_salt=cache_salt, adapter_id=adapter_id):
            return False
        self.window_group.allocate(seq_id, num_tokens, num_hit, window_ids)
        return True

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]] | None:
        """``BlockAllocator.grow`` over both groups; the window group's copy-on-write copies
        wait in ``take_window_copies``."""
        if seq_id in self._seqs and not self.window_group.can_grow(seq_id, num_tokens):
            return None
        copies = super().grow(seq_id, num_tokens)
        if copies is not None:
            self._window_copies += self.window_group.grow(seq_id, num_tokens)
        return copies

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        super().commit(seq_id, token_ids)
        table = self._seqs[seq_id].block_table
        self.window_group.commit(seq_id, len(token_ids), lambda i: self._block_key[table[i]])

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        super().fork(parent_id, child_id)
        self.window_group.fork(parent_id, child_id)

    def free(self, seq_id: Hashable) -> None:
        super().free(seq_id)
        self.window_group.free(seq_id)

    def trim(self, seq_id: Hashable, num_tokens: int) -> None:
        super().trim(seq_id, num_tokens)
        self.window_group.trim(seq_id, len(self._seqs[seq_id].block_table))

    def window_table(self, seq_id: Hashable) -> list[int]:
        return self.window_group.table(seq_id)

    def take_window_copies(self) -> list[tuple[int, int]]:
        """The window group's copy-on-write copies since the last call."""
        copies, self._window_copies = self._window_copies, []
        return copies

    def take_window_released(self) -> list[int]:
        return self.window_group.take_released()

    def pool_lost(self, unwritten: Sequence[int]) -> list[Hashable]:
        dropped = super().pool_lost(unwritten)
        self.window_group.reset_prefix_cache()
        self.window_group.take_released()
        return dropped

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        return self.window_group.reset_prefix_cache()

    def usage(self) -> dict[str, float | int]:
        return {**super().usage(), **self.window_group.usage()}

    def check_invariants(self) -> None:
        super().check_invariants()
        self.window_group.check_invariants()
        assert set(self._seqs) == set(self.window_group._seqs), "groups hold different seqs"
        for seq_id, seq in self._seqs.items():
            window = self.window_group._seqs[seq_id]
            assert len(window.table) == len(seq.block_table), f"{seq_id!r}: table lengths"
            assert window.num_computed_tokens == seq.num_computed_tokens
