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

The host tier (``TieredAllocator``) covers both groups, each with a ``HostBlockPool`` of its
own (``window_host_blocks`` sizes the window group's): the window group's host blocks hold
its layers' K/V only. Host block ids of the window group follow the full group's in the
step's swap plans (``take_swaps``): a pair's host id says which group's pools it moves.

* Swap: a preempted sequence keeps, beside its full group's blocks, the window blocks its
  kept tokens' next queries read (``[first_needed(keep), ceil(keep / block_size))``), one
  host block per distinct device block, keyed as on the device; swapped in, its window
  table is null before them again, and a full block whose content the window group still
  caches on the device is taken from there without a copy. A sample rewound by a token
  whose window needs a block it already released (a beam waiting for its siblings) is
  recomputed instead (``swap_out`` refuses).
* Host prefix tier: a keyed window block evicted from the device LRU is copied into the
  window group's host LRU, as the full group's are. A hit of ``k`` blocks needs each window
  block of ``[first_needed(k * block_size), k)`` on the device or in that host tier (the
  host ones are copied into fresh window blocks); the hit is cut, as on the device, to the
  longest ``k`` for which both groups hold what it needs. Why keep every evicted window
  block and not recompute the window from the hit: a window layer's K/V at a position needs
  every layer's forward up to it, so "recomputing the window" means prefilling the last
  window of the prefix in full, the full layers included, which is what a shorter hit
  already does. Any level can end a later hit (a shared system prompt's end, a
  conversation's last turn), so the host LRU, not a rule, decides which blocks stay.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from jaxpage.engine.block_allocator import NULL_BLOCK, AllocationError, PrefixHit
from jaxpage.engine.block_hashing import _EXTRA, _HASH, _PARENT, _TOKENS, _BlockKey, match_block
from jaxpage.engine.host_pool import HostBlockPool
from jaxpage.engine.tiered_allocator import TieredAllocator


def window_blocks_per_seq(window: int, block_size: int, max_chunk: int, max_model_len: int) -> int:
    """Most window blocks one sequence holds at once: during a step computing up to
    `max_chunk` tokens after `n` computed ones, the blocks from position n - window + 1 to
    n + max_chunk - 1 (capped by the blocks of a whole `max_model_len` sequence)."""
    span = -(-(window - 1 + max_chunk) // block_size) + 1
    return min(span, -(-max_model_len // block_size))


def window_host_blocks(num_host_blocks: int, num_blocks: int, num_window_blocks: int) -> int:
    """The window group's host blocks beside the full group's `num_host_blocks`: the share
    its device pool has of the device's usable blocks (at least one), so the host tier can
    hold what the device pool holds in the same proportions (0 without a host pool)."""
    if not num_host_blocks:
        return 0
    return max(1, -(-num_host_blocks * (num_window_blocks - 1) // (num_blocks - 1)))


@dataclass(slots=True)
class _WindowSeq:
    table: list[int]  # NULL_BLOCK where the block left the window
    num_computed_tokens: int


@dataclass(slots=True)
class _WindowSwapped:
    host_table: list[int]  # host blocks of indices [first_needed(n), ceil(n / block_size))
    num_computed_tokens: int  # n


class WindowGroup:
    """The window group's blocks: ref counts, a FIFO of never-keyed free blocks, an LRU of
    released blocks still holding a keyed (full) block's content, and each sequence's window
    table. Allocation order and ownership rules are the ``BlockAllocator``'s (see its module
    docstring); copy-on-write applies to forked sequences' shared blocks the same way."""

    def __init__(self, num_blocks: int, block_size: int, window: int, *,
                 track_released: bool = False, host: HostBlockPool | None = None) -> None:
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
        # the host tier (the module docstring): swapped-out sequences, the step's copies
        self.host = host if host is not None else HostBlockPool(0, caching=False)
        self._swapped: dict[Hashable, _WindowSwapped] = {}
        self._swap_out_plan: dict[int, int] = {}  # host block -> device block it receives
        self._swap_in_plan: list[tuple[int, int]] = []  # (host block, device block)
        self._num_host_hit_blocks = 0

    def first_needed(self, num_computed: int) -> int:
        """Index of the first block the next queries of a sequence with `num_computed`
        tokens read (they see keys from position num_computed - window + 1 on)."""
        return max(0, (num_computed - self.window + 1) // self.block_size)

    # ---------------------------------------------------------------- prefix hits

    def lookup(self, hashes: Sequence[bytes], keys: Sequence[_BlockKey]
               ) -> tuple[int, list[int], list[int]]:
        """The longest hit, ``(k, window block ids, host block ids)``, a full-group hit of
        ``len(hashes)`` blocks (their hashes and keys) can keep: the window group must hold
        blocks ``[first_needed(k * block_size), k)``, each on the device or in its host
        tier (there: NULL_BLOCK among the ids and the host block at the same place of the
        host ids, -1 elsewhere; no host ids when none is on the host). Scans down from the
        top: a miss at level j rules out every hit longer than j that needs it."""
        k = len(hashes)
        while k > 0:
            ids, host_ids = [], []
            for j in range(self.first_needed(k * self.block_size), k):
                block_id, host_id = self._find(hashes[j], keys[j]), -1
                if block_id is None:
                    host_id = self.host.find_key(keys[j]) if keys[j] is not None else None
                    if host_id is None:
                        k = j
                        break
                    block_id = NULL_BLOCK
                ids.append(block_id)
                host_ids.append(host_id)
            else:
                return k, ids, host_ids if any(h >= 0 for h in host_ids) else []
        return 0, [], []

    def _find(self, block_hash: bytes, key: _BlockKey) -> int | None:
        bucket = self._hash_to_blocks.get(block_hash)
        if not bucket:
            return None
        return match_block(bucket, self._key, key[_TOKENS], key[_EXTRA], key[_PARENT])

    # ---------------------------------------------------------------- allocation

    def _fresh_needed(self, num_tokens: int, num_hit: int, hit_ids: Sequence[int],
                      host_ids: Sequence[int]) -> int:
        """Fresh blocks ``allocate`` takes, after checking the hit's blocks are current."""
        for i, block_id in enumerate(hit_ids):
            if host_ids and host_ids[i] >= 0:
                host_id = host_ids[i]
                if not (block_id == NULL_BLOCK and 0 <= host_id < self.host.num_blocks
                        and self.host.key(host_id) is not None):
                    raise AllocationError(f"stale prefix hit: window host block {host_id} no "
                                          "longer holds the hashed content; lookup right "
                                          "before allocate")
            elif not (0 < block_id < self.num_blocks) or self._key[block_id] is None:
                raise AllocationError(f"stale prefix hit: window block {block_id} no longer "
                                      "holds the hashed content; lookup right before allocate")
        return -(-num_tokens // self.block_size) - num_hit + sum(1 for h in host_ids if h >= 0)

    def can_allocate(self, num_tokens: int, num_hit: int, hit_ids: Sequence[int],
                     host_ids: Sequence[int] = ()) -> bool:
        hit_free = sum(1 for b in hit_ids if b != NULL_BLOCK and self._ref_count[b] == 0)
        return self._fresh_needed(num_tokens, num_hit, hit_ids, host_ids) <= (
            self.num_free_blocks - hit_free)

    def allocate(self, seq_id: Hashable, num_tokens: int, num_hit: int,
                 hit_ids: Sequence[int], host_ids: Sequence[int] = ()) -> None:
        """Register a sequence (``can_allocate`` said yes): the hit's window blocks (those in
        the host tier copied into fresh blocks, this step's swap-ins), null entries before
        them, fresh blocks for the rest of ``num_tokens``."""
        need = self._fresh_needed(num_tokens, num_hit, hit_ids, host_ids)
        host_ids = host_ids or [-1] * len(hit_ids)
        for host_id in host_ids:  # before fresh blocks evict into the host tier
            if host_id >= 0:
                self.host.pin(host_id)
        for block_id in hit_ids:
            if block_id == NULL_BLOCK:
                continue
            if self._ref_count[block_id] == 0:
                del self._cached_free[block_id]
            self._ref_count[block_id] += 1
        window_ids = []
        for block_id, host_id in zip(hit_ids, host_ids, strict=True):
            if host_id >= 0:
                block_id = self._take_free_block()
                self._install_key(block_id, self.host.key(host_id))
                self._swap_in_plan.append((host_id, block_id))
                self._num_host_hit_blocks += 1
                need -= 1
            window_ids.append(block_id)
        table = [NULL_BLOCK] * (num_hit - len(hit_ids)) + window_ids
        table += [self._take_free_block() for _ in range(need)]
        self._seqs[seq_id] = _WindowSeq(table, num_hit * self.block_size)

    def _install_key(self, block_id: int, key: _BlockKey) -> None:
        self._key[block_id] = key
        self._hash_to_blocks.setdefault(key[_HASH], {})[block_id] = None

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
            self._keep_on_host(block_id)
            self._forget(block_id)
        self._ref_count[block_id] = 1
        if self._released is not None:
            self._released.append(block_id)
        return block_id

    def _keep_on_host(self, block_id: int) -> None:
        """A cached block is evicted: keep its content in the host tier (unless the host
        holds it already, or every host block is held)."""
        if not self.host.caching:
            return
        key = self._key[block_id]
        host_id = self.host.find_key(key)
        if host_id is not None:
            self.host.touch(host_id)
            return
        host_id = self.host.take(key, 0)
        if host_id is not None:
            self._swap_out_plan[host_id] = block_id

    def _forget(self, block_id: int) -> None:
        key = self._key[block_id]
        bucket = self._hash_to_blocks[key[_HASH]]
        del bucket[block_id]
        if not bucket:
            del self._hash_to_blocks[key[_HASH]]
        self._key[block_id] = None

    # ---------------------------------------------------------------- swapping

    def plan_swap_out(self, seqs: Sequence[tuple[Hashable, int]], pending: dict[int, int]
                      ) -> tuple[list[list[int]], dict[int, int], dict[int, int]] | None:
        """``swap_out``'s checks, changing nothing: (per sequence the device blocks its kept
        tokens' window is read from, each distinct one's table entries, those whose content
        the host holds already -> that host block), or None where it must refuse (a block
        the window needs was released, or the host lacks room). ``pending`` maps the
        destination of a copy-on-write copy not made yet to its source, read instead."""
        bs = self.block_size
        incoming = {device_id for _, device_id in self._swap_in_plan}
        tables, counts = [], {}
        for seq_id, keep in seqs:
            seq = self._seq(seq_id)
            table = [pending.get(b, b) for b in seq.table[self.first_needed(keep):-(-keep // bs)]]
            if NULL_BLOCK in table:
                return None
            for block_id in table:
                if block_id in incoming:
                    raise AllocationError(f"seq {seq_id!r}: window block {block_id} is filled "
                                          "by this step's swap-ins, which run after its "
                                          "swap-outs")
                counts[block_id] = counts.get(block_id, 0) + 1
            tables.append(table)
        found = {b: self.host.find_key(self._key[b]) for b in counts if self._key[b] is not None}
        found = {b: h for b, h in found.items() if h is not None}
        cached = sum(1 for h in set(found.values()) if self.host.is_cached(h))
        if len(counts) - len(found) > self.host.num_available - cached:
            return None
        return tables, counts, found

    def apply_swap_out(self, seqs: Sequence[tuple[Hashable, int]],
                       plan: tuple[list[list[int]], dict[int, int], dict[int, int]]) -> None:
        """Record the sequences' window host tables (``plan_swap_out``'s plan); the caller
        then frees them."""
        tables, counts, found = plan
        host_of = self.host.place(counts, found, self._key.__getitem__, self._swap_out_plan)
        for (seq_id, keep), table in zip(seqs, tables, strict=True):
            self._swapped[seq_id] = _WindowSwapped([host_of[b] for b in table], keep)

    def plan_swap_in(self, seqs: Sequence[tuple[Hashable, int]]
                     ) -> tuple[list[tuple[Hashable, _WindowSwapped, int]],
                                dict[int, int | None]] | None:
        """``swap_in``'s checks for the window group, changing nothing: per sequence
        ``(seq_id, num_tokens)`` its record and table length, and each full host block ->
        the device block still caching its content (None: copied); None when the window
        pool is short."""
        bs = self.block_size
        plans, reuse, fresh = [], {}, 0
        for seq_id, num_tokens in seqs:
            record = self._swapped.get(seq_id)
            if record is None:
                raise AllocationError(f"seq_id {seq_id!r} is not swapped out")
            computed = record.num_computed_tokens
            if num_tokens < computed:
                raise ValueError(f"num_tokens={num_tokens} < its {computed} computed tokens")
            first = self.first_needed(computed)
            for i, host_id in enumerate(record.host_table, first):
                if i >= computed // bs:  # a partly filled block: one copy each
                    fresh += 1
                elif host_id not in reuse:
                    key = self.host.key(host_id)
                    reuse[host_id] = None if key is None else self._find(key[_HASH], key)
                    fresh += reuse[host_id] is None
            end = -(-num_tokens // bs)
            fresh += end - first - len(record.host_table)
            plans.append((seq_id, record, end))
        reused = {b for b in reuse.values() if b is not None}
        if fresh > self.num_free_blocks - sum(1 for b in reused if self._ref_count[b] == 0):
            return None
        return plans, reuse

    def apply_swap_in(self, plan: tuple[list[tuple[Hashable, _WindowSwapped, int]],
                                        dict[int, int | None]]) -> None:
        """Bring the sequences' windows back (``plan_swap_in``'s plan): null entries before
        them, full blocks shared again, the rest copied from the host (this step's
        swap-ins), fresh blocks up to each table's length."""
        plans, reuse = plan
        for block_id in {b for b in reuse.values() if b is not None}:
            if self._ref_count[block_id] == 0:  # out of the LRU before fresh blocks are taken
                del self._cached_free[block_id]
        bs, copied = self.block_size, {}  # full host block -> its fresh device block
        for seq_id, record, end in plans:
            computed = record.num_computed_tokens
            first = self.first_needed(computed)
            table = [NULL_BLOCK] * first
            for i, host_id in enumerate(record.host_table, first):
                full = i < computed // bs
                block_id = (reuse[host_id] if reuse[host_id] is not None
                            else copied.get(host_id)) if full else None
                if block_id is None:
                    block_id = self._take_free_block()  # count 1
                    self._swap_in_plan.append((host_id, block_id))
                    self.host.pin(host_id)
                    key = self.host.key(host_id)
                    if full:
                        copied[host_id] = block_id
                        if key is not None:
                            self._install_key(block_id, key)
                else:
                    self._ref_count[block_id] += 1
                table.append(block_id)
            table += [self._take_free_block() for _ in range(end - len(table))]
            del self._swapped[seq_id]
            for host_id in record.host_table:
                self.host.release(host_id)
            self._seqs[seq_id] = _WindowSeq(table, computed)

    def drop_swapped(self, seq_id: Hashable) -> None:
        """Forget a swapped-out sequence's window: its host blocks are released."""
        for host_id in self._swapped.pop(seq_id).host_table:
            self.host.release(host_id)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's window copies, ``(device, host)`` out and ``(host, device)`` in, in
        this group's own block ids; ends the step for its host pool."""
        swap_out = [(device_id, host_id) for host_id, device_id in self._swap_out_plan.items()]
        swap_in, self._swap_in_plan, self._swap_out_plan = self._swap_in_plan, [], {}
        self.host.end_step()
        return swap_out, swap_in

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
                "window_free": free, "window_usage": used / usable,
                **{f"window_{name}": value for name, value in self.host.usage().items()},
                "window_host_hits": self._num_host_hit_blocks}

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
        held = [0] * self.host.num_blocks
        for seq_id, record in self._swapped.items():
            n, table = record.num_computed_tokens, record.host_table
            assert seq_id not in self._seqs, f"window seq {seq_id!r} live and swapped out"
            assert len(table) == -(-n // bs) - self.first_needed(n), (
                f"swapped window seq {seq_id!r}: host table {table} for {n} tokens")
            assert len(set(table)) == len(table), f"swapped window seq {seq_id!r}: duplicate"
            for host_id in table:
                held[host_id] += 1
        self.host.check_invariants(held)


class WindowedAllocator(TieredAllocator):
    """The allocator of a model with sliding-window layers: the ``TieredAllocator`` for the
    full group plus a ``WindowGroup`` moved in lockstep (module docstring), each with its
    host pool (the window group's ``window_host_blocks``). Every operation is
    all-or-nothing over both groups."""

    def __init__(self, num_blocks: int, block_size: int, *, window: int, num_window_blocks: int,
                 track_released: bool = False, **kwargs) -> None:
        super().__init__(num_blocks, block_size, track_released=track_released, **kwargs)
        host = HostBlockPool(
            window_host_blocks(self.host.num_blocks, num_blocks, num_window_blocks),
            caching=self.enable_prefix_caching and kwargs.get("enable_host_prefix_cache", True))
        self.window_group = WindowGroup(num_window_blocks, block_size, window,
                                        track_released=track_released, host=host)
        self._window_copies: list[tuple[int, int]] = []

    def lookup(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
               adapter_id: str | int | None = None) -> PrefixHit:
        """The full group's hit (both tiers), cut to the longest prefix whose window blocks
        the window group still holds (either tier)."""
        hit = super().lookup(token_ids, cache_salt=cache_salt, adapter_id=adapter_id)
        keys = ([self._block_key[b] for b in hit.block_ids]
                + [self.host.key(h) for h in hit.host_block_ids])
        k, window_ids, window_host = self.window_group.lookup(hit.block_hashes, keys)
        num_device = len(hit.block_ids)
        return PrefixHit(hit.block_ids[:k], hit.block_hashes[:k], k * self.block_size,
                         cache_salt, adapter_id, hit.host_block_ids[:max(0, k - num_device)],
                         tuple(window_ids), tuple(window_host))

    def allocate(self, seq_id: Hashable, num_tokens: int, hit: PrefixHit | None = None, *,
                 final_num_tokens: int | None = None, cache_salt: str | None = None,
                 adapter_id: str | int | None = None) -> bool:
        num_hit, window_ids, window_host = 0, (), ()
        if hit is not None:
            num_hit = len(hit.block_ids) + len(hit.host_block_ids)
            window_ids, window_host = hit.window_block_ids, hit.window_host_block_ids
        if seq_id in self._seqs or seq_id in self._swapped:
            raise AllocationError(f"seq_id {seq_id!r} is already allocated")
        if not self.window_group.can_allocate(num_tokens, num_hit, window_ids, window_host):
            return False
        if not super().allocate(seq_id, num_tokens, hit, final_num_tokens=final_num_tokens,
                                cache_salt=cache_salt, adapter_id=adapter_id):
            return False
        self.window_group.allocate(seq_id, num_tokens, num_hit, window_ids, window_host)
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

    # ---------------------------------------------------------------- swapping

    def swap_out(self, seqs: Sequence[tuple[Hashable, int]],
                 pending_copies: dict[int, int] | None = None) -> bool:
        """``TieredAllocator.swap_out`` over both groups: the window group keeps each kept
        prefix's window (``WindowGroup.plan_swap_out``; its copy-on-write copies planned
        this step are read at their sources). Refused, changing nothing, where either
        group refuses."""
        plan = self._plan_swap_out(seqs, pending_copies or {})
        if plan is None:
            return False
        window_plan = self.window_group.plan_swap_out(
            seqs, {dst: src for src, dst in self._window_copies})
        if window_plan is None:
            return False
        self.window_group.apply_swap_out(seqs, window_plan)
        self._apply_swap_out(seqs, plan)  # frees both groups' device blocks
        return True

    def window_blocks_to_swap_out(self, seqs: Sequence[tuple[Hashable, int]]) -> int:
        """Distinct window-group blocks ``swap_out`` would read for these sequences (0 where
        the window group would refuse)."""
        plan = self.window_group.plan_swap_out(
            seqs, {dst: src for src, dst in self._window_copies})
        return 0 if plan is None else len(plan[1])

    def swap_in(self, seqs: Sequence[tuple[Hashable, int, int | None]]) -> bool:
        """``TieredAllocator.swap_in`` over both groups; the window tables cover
        ``num_tokens`` (as ``allocate``'s do)."""
        window_plan = self.window_group.plan_swap_in([(s, n) for s, n, _ in seqs])
        if window_plan is None or not super().swap_in(seqs):
            return False
        self.window_group.apply_swap_in(window_plan)
        return True

    def drop_swapped(self, seq_id: Hashable) -> None:
        super().drop_swapped(seq_id)
        self.window_group.drop_swapped(seq_id)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Both groups' copies; the window group's host blocks numbered after the full
        group's (``host.num_blocks`` on), its device blocks in its own pool."""
        swap_out, swap_in = super().take_swaps()
        window_out, window_in = self.window_group.take_swaps()
        offset = self.host.num_blocks
        return (swap_out + [(device_id, offset + host_id) for device_id, host_id in window_out],
                swap_in + [(offset + host_id, device_id) for host_id, device_id in window_in])

    def take_window_copies(self) -> list[tuple[int, int]]:
        """The window group's copy-on-write copies since the last call."""
        copies, self._window_copies = self._window_copies, []
        return copies

    def take_window_released(self) -> list[int]:
        return self.window_group.take_released()

    def pool_lost(self, unwritten: Sequence[int]) -> list[Hashable]:
        """``TieredAllocator.pool_lost`` over both groups (``unwritten`` in ``take_swaps``'s
        numbering): a swapped-out sequence holding an unwritten host block of either group
        is dropped."""
        offset, group = self.host.num_blocks, self.window_group
        lost = {h - offset for h in unwritten if h >= offset}
        also = [s for s, record in group._swapped.items() if lost.intersection(record.host_table)]
        dropped = super().pool_lost([h for h in unwritten if h < offset])
        for seq_id in also:
            if seq_id not in dropped:
                self.drop_swapped(seq_id)
                dropped.append(seq_id)
        for host_id in lost:
            group.host.invalidate(host_id)
        group.reset_prefix_cache()
        group.take_released()
        return dropped

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache() or not self.window_group.reset_prefix_cache():
            return False
        self.window_group.host.reset()
        return True

    def usage(self) -> dict[str, float | int]:
        return {**super().usage(), **self.window_group.usage()}

    def check_invariants(self) -> None:
        super().check_invariants()
        self.window_group.check_invariants()
        assert set(self._seqs) == set(self.window_group._seqs), "groups hold different seqs"
        assert set(self._swapped) == set(self.window_group._swapped), (
            "groups hold different swapped-out seqs")
        for seq_id, seq in self._seqs.items():
            window = self.window_group._seqs[seq_id]
            assert len(window.table) == len(seq.block_table), f"{seq_id!r}: table lengths"
            assert window.num_computed_tokens == seq.num_computed_tokens
