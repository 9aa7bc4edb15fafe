"""Host-side block allocator for the paged KV cache (plain Python, no JAX).

The pool holds ``num_blocks`` blocks of ``block_size`` tokens; block 0 is the null block (padding
writes land there), never handed out. The allocator owns one block table per live sequence (any
hashable ``seq_id``), the ref counts, the prefix cache (hash -> blocks) and the free structures.

Free structures and the exact allocation / eviction order:

* ``free`` -- never-hashed free blocks, a FIFO queue. It starts as ``1, 2, ..., num_blocks - 1``;
  a block whose count drops to 0 and that carries no hash is appended at the back.
* ``cached_free`` -- hashed free blocks, an LRU (``OrderedDict``), least recently used first. A
  block becomes "used" when it is released; ``free()`` releases a table tail first, so a finished
  sequence's last block is evicted before its first. A prefix hit on a cached-free block removes
  it from the LRU in O(1).
* A fresh block is taken from the front of ``free``; only when that is empty is the front of
  ``cached_free`` evicted (its hash dropped). A request's own hit blocks leave the LRU before any
  fresh block is taken, so they are never evicted to serve it. ``grow()`` takes fresh blocks in
  table-index order (copy-on-write replacements first, then appended blocks).
* ``reset_prefix_cache()`` appends the cached-free blocks, oldest first, to the back of ``free``.

Hashing (block hashes, extra keys, content-checked hits): see ``block_hashing``.

Invariants (``check_invariants`` verifies them):

1. free + cached_free + distinct in-use blocks == num_blocks - 1; block 0 is never used or free.
2. Each block's ref count equals the number of live table entries holding it; a block is in a
   free structure exactly when its count is 0, once; no table holds a block twice.
3. Every table holding a block holds it at the same index ``i`` and with the same fill
   ``clamp(num_computed_tokens - i * block_size, 0, block_size)``. So a shared block is either
   full in every sharer (and hashed, with prefix caching on) or a partly filled or empty block
   shared by ``fork()`` that nobody has written into since: writes need count 1 (``commit``
   refuses to write into a shared block; after ``grow(seq, n)`` every block covering positions
   ``[num_computed, n)`` has count 1).
4. Every hash-map entry points to a block whose key carries that hash and ``block_size`` tokens;
   with prefix caching on, every fully computed block of a live sequence is hashed.
5. A failed ``allocate``/``grow`` changes nothing.
6. With no live sequences all counts are 0 and every usable block is free or cached-free.

Errors: running out of blocks is normal (``allocate`` returns False, ``grow`` returns None).
Misuse of state (unknown or duplicate ``seq_id``, a stale hit, a write into a shared block) raises
``AllocationError``; out-of-range argument values raise ``ValueError``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from jaxpage.engine.block_hashing import (
    _HASH,
    _TOKENS,
    BlockHasher,
    _BlockKey,
    encode_extra_keys,
    match_block,
)

NULL_BLOCK = 0
POLICIES = ("paged", "max", "oracle")


class AllocationError(RuntimeError):
    """The allocator was used against its state (unknown/duplicate seq_id, stale hit, ...)."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Result of ``lookup``: the cached full blocks a prompt can reuse, in order: ``block_ids``
    in the device pool, then ``host_block_ids`` in the host tier (``TieredAllocator`` only),
    which are copied into fresh device blocks."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[bytes, ...] = ()  # one per block of either tier
    num_tokens: int = 0  # (len(block_ids) + len(host_block_ids)) * block_size
    cache_salt: str | None = None
    adapter_id: str | int | None = None
    host_block_ids: tuple[int, ...] = ()
    # the window group's blocks of the hit's last levels, those its next queries read
    # (``WindowedAllocator`` only; jaxpage.engine.kv_groups): each a device block, or
    # NULL_BLOCK where that level comes from the window group's host tier, whose block is
    # then the same entry of ``window_host_block_ids`` (-1 elsewhere; () with no host level)
    window_block_ids: tuple[int, ...] = ()
    window_host_block_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.block_ids) + len(self.host_block_ids) != len(self.block_hashes):
            raise ValueError(f"PrefixHit: {len(self.block_ids)} block_ids and "
                             f"{len(self.host_block_ids)} host_block_ids but "
                             f"{len(self.block_hashes)} block_hashes")
        if self.window_host_block_ids and (
                len(self.window_host_block_ids) != len(self.window_block_ids)):
            raise ValueError(f"PrefixHit: {len(self.window_block_ids)} window_block_ids but "
                             f"{len(self.window_host_block_ids)} window_host_block_ids")


@dataclass(slots=True)
class _Sequence:
    block_table: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]  # one per fully computed block (prefix caching on)
    extra: bytes
    cache_salt: str | None
    adapter_id: str | int | None


class BlockAllocator:
    """Paged KV block allocator with ref counts, prefix caching, fork and copy-on-write.

    Args:
        num_blocks: blocks in the pool including the null block 0 (>= 2).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: hash committed full blocks and serve ``lookup`` hits.
        policy: "paged" allocates on demand; "max" reserves ``max_model_len`` tokens per sequence
            at ``allocate``; "oracle" reserves ``final_num_tokens`` (prompt + max_tokens).
        max_model_len: longest sequence in tokens; required for "max", enforced when given.
        hash_fn: bytes -> digest; default SHA-256 (stable across processes).
        track_released: record every block whose content stops being anyone's (freed
            unhashed, evicted, handed out fresh) for ``take_released`` (debugging: the engine
            refills those blocks with NaN so that a stale read shows).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 policy: str = "paged", max_model_len: int | None = None,
                 hash_fn: Callable[[bytes], bytes] | None = None,
                 track_released: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if policy == "max" and max_model_len is None:
            raise ValueError("policy 'max' requires max_model_len")
        self.num_blocks, self.block_size, self.policy = num_blocks, block_size, policy
        self.enable_prefix_caching, self.max_model_len = enable_prefix_caching, max_model_len
        self._hasher = BlockHasher(block_size, hash_fn)
        self._ref_count = [0] * num_blocks
        self._block_key: list[_BlockKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_blocks: dict[bytes, dict[int, None]] = {}
        self._seqs: dict[Hashable, _Sequence] = {}
        self._num_query_tokens = self._num_hit_tokens = 0  # prefix-cache stats, in tokens
        self._released: list[int] | None = [] if track_released else None

    # ---------------------------------------------------------------- hashing and lookup

    def hash_blocks(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                    adapter_id: str | int | None = None) -> list[bytes]:
        """Chained hashes of every full block of ``token_ids`` (a partial tail is skipped)."""
        return self._hasher.hash_blocks(token_ids, encode_extra_keys(cache_salt, adapter_id))

    def lookup(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
               adapter_id: str | int | None = None) -> PrefixHit:
        """Longest run of cached full blocks that start ``token_ids``; changes no state.

        Hashes block by block and stops at the first miss. At most ``(len - 1) // block_size``
        blocks hit, so the last token is always computed (its logits are needed).
        """
        extra = encode_extra_keys(cache_salt, adapter_id)
        if not self.enable_prefix_caching:
            return PrefixHit(cache_salt=cache_salt, adapter_id=adapter_id)
        bs, block_ids, hashes = self.block_size, [], []
        parent_hash, parent_key = b"", None
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            level_extra = b"" if i else extra
            block_hash = self._hasher.block_hash(parent_hash, tokens, level_extra)
            block_id = match_block(self._hash_to_blocks.get(block_hash, ()), self._block_key,
                                   tokens, level_extra, parent_key)
            if block_id is None:
                break  # first miss ends the hit
            block_ids.append(block_id)
            hashes.append(block_hash)
            parent_hash, parent_key = block_hash, self._block_key[block_id]
        return PrefixHit(tuple(block_ids), tuple(hashes), len(block_ids) * bs,
                         cache_salt, adapter_id)

    # ---------------------------------------------------------------- allocation

    def _check_len(self, name: str, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"{name} must be >= 0, got {num_tokens}")
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(f"{name}={num_tokens} exceeds max_model_len={self.max_model_len}")

    def _blocks_for_new(self, num_tokens: int, hit: PrefixHit,
                        final_num_tokens: int | None) -> tuple[int, int]:
        """(fresh blocks needed, hit blocks that now sit in cached_free); validates the hit."""
        self._check_len("num_tokens", num_tokens)
        if hit.num_tokens != len(hit.block_ids) * self.block_size:
            raise ValueError(f"hit.num_tokens={hit.num_tokens} != {len(hit.block_ids)} blocks "
                             f"* block_size {self.block_size}")
        if num_tokens < hit.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} < hit.num_tokens={hit.num_tokens}")
        for block_id, block_hash in zip(hit.block_ids, hit.block_hashes, strict=True):
            key = self._block_key[block_id] if 0 < block_id < self.num_blocks else None
            if key is None or key[_HASH] != block_hash:
                raise AllocationError(f"stale prefix hit: block {block_id} no longer holds the "
                                      "hashed content; call lookup() right before allocate()")
        target = num_tokens
        if self.policy == "oracle":
            if final_num_tokens is None or final_num_tokens < num_tokens:
                raise ValueError(f"policy 'oracle' needs final_num_tokens >= num_tokens="
                                 f"{num_tokens}, got {final_num_tokens}")
            self._check_len("final_num_tokens", final_num_tokens)
        if self.policy != "paged":
            target = self.reserved_tokens(final_num_tokens)
        need = -(-target // self.block_size) - len(hit.block_ids)
        return need, sum(1 for b in hit.block_ids if self._ref_count[b] == 0)

    def reserved_tokens(self, final_num_tokens: int) -> int:
        """Tokens of blocks a sequence that grows to ``final_num_tokens`` holds at its most
        under the policy: ``max_model_len`` under "max", else ``final_num_tokens`` ("oracle"
        reserves them at ``allocate``, "paged" reaches them by ``grow``)."""
        return self.max_model_len if self.policy == "max" else final_num_tokens

    def can_allocate(self, num_tokens: int, hit: PrefixHit | None = None,
                     final_num_tokens: int | None = None) -> bool:
        """Whether ``allocate`` with the same arguments would succeed now."""
        need, hit_free = self._blocks_for_new(num_tokens, hit or PrefixHit(), final_num_tokens)
        return need <= self.num_free_blocks - hit_free

    def allocate(self, seq_id: Hashable, num_tokens: int, hit: PrefixHit | None = None, *,
                 final_num_tokens: int | None = None, cache_salt: str | None = None,
                 adapter_id: str | int | None = None) -> bool:
        """Register a new sequence covering ``num_tokens`` tokens, reusing ``hit``'s blocks.

        All-or-nothing: returns False, changing nothing, when the pool is short. The sequence
        starts with ``hit.num_tokens`` computed tokens. Salt and adapter default to the hit's.
        """
        if seq_id in self._seqs:
            raise AllocationError(f"seq_id {seq_id!r} is already allocated")
        hit = hit or PrefixHit(cache_salt=cache_salt, adapter_id=adapter_id)
        if hit.block_ids and ((cache_salt is not None and cache_salt != hit.cache_salt) or
                              (adapter_id is not None and adapter_id != hit.adapter_id)):
            raise ValueError("cache_salt/adapter_id differ from those the hit was looked up with")
        cache_salt = hit.cache_salt if cache_salt is None else cache_salt
        adapter_id = hit.adapter_id if adapter_id is None else adapter_id
        extra = encode_extra_keys(cache_salt, adapter_id)
        need, hit_free = self._blocks_for_new(num_tokens, hit, final_num_tokens)
        if need > self.num_free_blocks - hit_free:
            return False
        for block_id in hit.block_ids:
            if self._ref_count[block_id] == 0:
                del self._cached_free[block_id]
            self._ref_count[block_id] += 1
        table = list(hit.block_ids) + [self._take_free_block() for _ in range(need)]
        self._seqs[seq_id] = _Sequence(table, hit.num_tokens, list(hit.block_hashes), extra,
                                       cache_salt, adapter_id)
        if self.enable_prefix_caching:
            self._num_query_tokens += num_tokens
            self._num_hit_tokens += hit.num_tokens
        return True

    def _take_free_block(self) -> int:
        """Pop the next fresh block (never-hashed first, then evict the LRU cached block)."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            self._evict(block_id)
        self._ref_count[block_id] = 1
        if self._released is not None:
            self._released.append(block_id)
        return block_id

    def _evict(self, block_id: int) -> None:
        """Drop a cached block's hash: its content is about to be overwritten."""
        key = self._block_key[block_id]
        bucket = self._hash_to_blocks[key[_HASH]]
        del bucket[block_id]
        if not bucket:
            del self._hash_to_blocks[key[_HASH]]
        self._block_key[block_id] = None

    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise AllocationError(f"unknown seq_id {seq_id!r}") from None

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[tuple[int, int]] | None:
        """Make the table cover ``num_tokens`` tokens and own every block it will write.

        Blocks covering positions ``[num_computed, num_tokens)`` with count > 1 are replaced by
        fresh blocks (copy-on-write). Returns the ``(src, dst)`` copies the device must do before
        writing (only for replaced blocks already holding computed tokens), or None, changing
        nothing, when the pool is short.
        """
        seq = self._seq(seq_id)
        bs, table, computed = self.block_size, seq.block_table, seq.num_computed_tokens
        last = (num_tokens - 1) // bs
        if (computed < num_tokens and last == computed // bs and last < len(table)
                and self._ref_count[table[last]] == 1
                and (self.max_model_len is None or num_tokens <= self.max_model_len)):
            return []  # a decode's usual case: its one block is its own, nothing to do
        self._check_len("num_tokens", num_tokens)
        end = -(-num_tokens // bs)
        cow = []
        if num_tokens > computed:
            cow = [i for i in range(computed // bs, min(end, len(table)))
                   if self._ref_count[table[i]] > 1]
        append = max(0, end - len(table))
        if len(cow) + append > self.num_free_blocks:
            return None
        copies = []
        for i in cow:
            src, dst = table[i], self._take_free_block()
            self._ref_count[src] -= 1  # stays >= 1: src never enters a free structure here
            table[i] = dst
            if computed > i * bs:
                copies.append((src, dst))
        table.extend(self._take_free_block() for _ in range(append))
        return copies

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Record that the KV of all ``token_ids`` of the sequence is written.

        Sets ``num_computed_tokens = len(token_ids)`` and, with prefix caching on, hashes and
        caches each block that became full (only those not hashed yet).
        """
        seq = self._seq(seq_id)
        bs, table, n = self.block_size, seq.block_table, len(token_ids)
        old = seq.num_computed_tokens
        if not old <= n <= len(table) * bs:
            raise ValueError(f"commit of {n} tokens: must be in [num_computed_tokens={old}, "
                             f"table capacity={len(table) * bs}]")
        ref_count = self._ref_count
        for i in range(old // bs, -(-n // bs)) if n > old else ():
            if ref_count[table[i]] > 1:
                raise AllocationError(f"seq {seq_id!r} would write into shared block {table[i]} "
                                      f"(index {i}); call grow() first for copy-on-write")
        seq.num_computed_tokens = n
        hashes = seq.block_hashes
        if not self.enable_prefix_caching or n // bs == len(hashes):  # no block filled
            return
        for i in range(len(hashes), n // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            extra = b"" if i else seq.extra
            parent_key = self._block_key[table[i - 1]] if i else None
            block_hash = self._hasher.block_hash(hashes[i - 1] if i else b"", tokens, extra)
            self._block_key[table[i]] = (block_hash, tokens, parent_key, extra)
            self._hash_to_blocks.setdefault(block_hash, {})[table[i]] = None
            hashes.append(block_hash)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Register ``child_id`` sharing all of the parent's blocks, computed count and keys."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise AllocationError(f"seq_id {child_id!r} is already allocated")
        for block_id in parent.block_table:
            self._ref_count[block_id] += 1
        self._seqs[child_id] = _Sequence(list(parent.block_table), parent.num_computed_tokens,
                                         list(parent.block_hashes), parent.extra,
                                         parent.cache_salt, parent.adapter_id)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; its blocks are released tail first (evicted before its head)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for block_id in reversed(seq.block_table):
            self._release(block_id)

    def trim(self, seq_id: Hashable, num_tokens: int) -> None:
        """Give back the table's blocks past those that hold ``num_tokens`` tokens (never
        fewer than its computed ones): the blocks a speculative step took for drafts it then
        rejected. Under the "max" and "oracle" policies the table keeps its reservation."""
        if self.policy != "paged":
            return
        seq = self._seq(seq_id)
        keep = -(-max(num_tokens, seq.num_computed_tokens) // self.block_size)
        table = seq.block_table
        while len(table) > keep:
            self._release(table.pop())

    def _release(self, block_id: int) -> None:
        """One table entry of ``block_id`` is gone: at no holder left, the block is free (or
        cached-free while it holds a hashed block's content)."""
        self._ref_count[block_id] -= 1
        if self._ref_count[block_id] == 0:
            if self._block_key[block_id] is None:
                self._free.append(block_id)
                if self._released is not None:
                    self._released.append(block_id)
            else:
                self._cached_free[block_id] = None

    def take_released(self) -> list[int]:
        """Blocks released since the last call (distinct, in release order); always empty
        unless built with ``track_released``."""
        if not self._released:
            return []
        released, self._released = list(dict.fromkeys(self._released)), []
        return released

    # ---------------------------------------------------------------- queries

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._seq(seq_id).block_table)

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence whose KV is written (a hit's tokens count from ``allocate``)."""
        return self._seq(seq_id).num_computed_tokens

    def ref_count(self, block_id: int) -> int:
        """How many live block tables hold ``block_id``."""
        return self._ref_count[block_id]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate``/``grow`` can hand out: never-hashed free + cached free."""
        return len(self._free) + len(self._cached_free)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block_id in self._cached_free:
            self._block_key[block_id] = None
            self._free.append(block_id)
            if self._released is not None:
                self._released.append(block_id)
        self._cached_free.clear()
        self._hash_to_blocks.clear()
        return True

    def usage(self) -> dict[str, float | int]:
        """Block counts (usable blocks exclude the null block) and prefix-cache stats in tokens."""
        usable, free, cached = self.num_blocks - 1, len(self._free), len(self._cached_free)
        used = usable - free - cached  # distinct blocks held by live tables
        return {"num_blocks": usable, "used": used, "cached_free": cached, "free": free,
                "usage": used / usable, "prefix_cache_queries": self._num_query_tokens,
                "prefix_cache_hits": self._num_hit_tokens}

    def check_invariants(self) -> None:
        """Assert invariants 1-4 and 6 of the module docstring (O(blocks + table entries))."""
        bs, n_blocks, caching = self.block_size, self.num_blocks, self.enable_prefix_caching
        counts = [0] * n_blocks
        share_state: dict[int, object] = {}
        for seq_id, seq in self._seqs.items():
            table, computed = seq.block_table, seq.num_computed_tokens
            assert len(set(table)) == len(table), f"seq {seq_id!r}: duplicate block in {table}"
            assert 0 <= computed <= len(table) * bs, f"seq {seq_id!r}: computed {computed} > cap"
            if caching:
                assert len(seq.block_hashes) == computed // bs, f"seq {seq_id!r}: hash count"
            for i, block_id in enumerate(table):
                assert 0 < block_id < n_blocks, f"seq {seq_id!r}: bad block id {block_id}"
                counts[block_id] += 1
                full = (i + 1) * bs <= computed
                if caching and full:
                    key = self._block_key[block_id]
                    assert key is not None and key[_HASH] == seq.block_hashes[i], (
                        f"seq {seq_id!r}: full block {block_id} (index {i}) not hashed as its seq")
                state = (i, min(max(computed - i * bs, 0), bs))  # (index, fill)
                assert share_state.setdefault(block_id, state) == state, (
                    f"block {block_id} shared inconsistently (inv. 3): {share_state[block_id]} "
                    f"vs seq {seq_id!r} {state}")
        assert self._ref_count == counts, "(block, ref count, live table entries): " + str(
            [(b, r, c) for b, (r, c) in enumerate(zip(self._ref_count, counts, strict=True))
             if r != c][:5])
        assert len(set(self._free)) == len(self._free), "duplicate in free queue"
        for block_id in self._free:
            assert 0 < block_id < n_blocks and counts[block_id] == 0, f"free block {block_id} used"
            assert self._block_key[block_id] is None, f"free block {block_id} is hashed"
        for block_id in self._cached_free:
            assert counts[block_id] == 0, f"cached-free block {block_id} is in use"
            assert self._block_key[block_id] is not None, f"cached-free block {block_id} unhashed"
        in_use = sum(1 for c in counts if c)
        assert len(self._free) + len(self._cached_free) + in_use == n_blocks - 1, (
            f"conservation: {len(self._free)} free + {len(self._cached_free)} cached + "
            f"{in_use} used != {n_blocks - 1}")
        entries = 0
        for block_hash, bucket in self._hash_to_blocks.items():
            assert bucket, "empty hash bucket"
            for block_id in bucket:
                key = self._block_key[block_id]
                assert key is not None and key[_HASH] == block_hash, f"map -> {block_id}"
                assert len(key[_TOKENS]) == bs, f"hashed block {block_id} is not full"
            entries += len(bucket)
        hashed = sum(1 for key in self._block_key if key is not None)
        assert entries == hashed, f"{hashed} hashed blocks but {entries} map entries"
        assert caching or hashed == 0, "hashed blocks with prefix caching off"
