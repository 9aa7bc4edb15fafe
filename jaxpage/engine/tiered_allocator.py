"""The block allocator with a host tier: swap-out preemption and a second level of the prefix
cache (plain Python, no JAX).

``TieredAllocator`` is the device ``BlockAllocator`` plus a ``HostBlockPool``:

* Swap out (``swap_out``): preempted sequences leave the device and keep host tables. Every
  block holding computed tokens goes to one host block, however many of the sequences share
  it (a block whose copy-on-write copy is still pending is read at its source). A full block
  the host tier already holds is not copied again. The device blocks are then released as
  ``free`` releases them.
* Swap in (``swap_in``): the sequences come back with device blocks for all their host
  blocks. A full block shared on the host is shared again on the device, and one whose
  content is still cached on the device is taken from there without a copy; a partly filled
  block gets a copy per sequence, since each writes its next token into it (the one
  copy-on-write copy per sharer it would need anyway, made from the host instead).
* Host tier of the prefix cache (``host.caching``: prefix caching on, a host pool, and
  ``enable_host_prefix_cache``): a cached block evicted from the device LRU is copied into a
  host block (the host LRU makes room) unless the host already holds that content; ``lookup``
  continues into the host tier from the first level the device misses, and ``allocate``
  copies those host blocks into fresh device blocks, which then count as computed.

Copies are not made here: each device->host copy is recorded in the step's swap-out plan
and each host->device copy in its swap-in plan; ``take_swaps`` hands both over at the end
of the step's schedule. The device must run every swap-out before anything writes the pool
in that step (the freed and evicted blocks may be handed out again in the same step), then
the swap-ins, then the copy-on-write copies.

Invariants (``check_invariants``, beyond the device allocator's): a sequence is live on the
device or swapped out, never both; a swapped-out sequence's host table has one distinct
block per block that held computed tokens, its full blocks keyed with its hashes (prefix
caching on); host ref counts equal the swapped-out table entries; and the host states
partition the host blocks (``HostBlockPool``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from jaxpage.engine.block_allocator import (
    AllocationError,
    BlockAllocator,
    PrefixHit,
    _Sequence,
)
from jaxpage.engine.block_hashing import (
    _EXTRA,
    _HASH,
    _PARENT,
    _TOKENS,
    _BlockKey,
    encode_extra_keys,
    match_block,
)
from jaxpage.engine.host_pool import HostBlockPool


@dataclass(slots=True)
class _SwappedSequence:
    host_table: list[int]  # one host block per block that held computed tokens
    num_computed_tokens: int
    block_hashes: list[bytes]
    extra: bytes
    cache_salt: str | None
    adapter_id: str | int | None


class TieredAllocator(BlockAllocator):
    """A ``BlockAllocator`` with a host pool of ``num_host_blocks`` blocks (see the module
    docstring); the other arguments are ``BlockAllocator``'s. With no host blocks it behaves
    as the device allocator alone."""

    def __init__(self, num_blocks: int, block_size: int, *, num_host_blocks: int = 0,
                 enable_host_prefix_cache: bool = True, **kwargs) -> None:
        super().__init__(num_blocks, block_size, **kwargs)
        self.host = HostBlockPool(num_host_blocks, caching=self.enable_prefix_caching
                                  and enable_host_prefix_cache)
        self._swapped: dict[Hashable, _SwappedSequence] = {}
        self._swap_out_plan: dict[int, int] = {}  # host block -> device block it receives
        self._swap_in_plan: list[tuple[int, int]] = []  # (host block, device block)
        self._num_host_hit_tokens = 0

    # ---------------------------------------------------------------- prefix cache, host tier

    def _evict(self, block_id: int) -> None:
        """A cached device block is evicted: keep its content in the host tier."""
        if self.host.caching:
            key = self._block_key[block_id]
            host_id = self.host.find_key(key)
            if host_id is not None:
                self.host.touch(host_id)
            else:
                host_id = self.host.take(key, 0)
                if host_id is not None:  # None: every host block is held; the content is lost
                    self._swap_out_plan[host_id] = block_id
        super()._evict(block_id)

    def lookup(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
               adapter_id: str | int | None = None) -> PrefixHit:
        """The device hit, continued in the host tier from the first level the device
        misses (so the device part stays a prefix); changes no state."""
        hit = super().lookup(token_ids, cache_salt=cache_salt, adapter_id=adapter_id)
        if not self.host.caching:
            return hit
        bs, hashes, host_ids = self.block_size, list(hit.block_hashes), []
        parent_key = self._block_key[hit.block_ids[-1]] if hit.block_ids else None
        extra = encode_extra_keys(cache_salt, adapter_id)
        for i in range(len(hashes), (len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            level_extra = b"" if i else extra
            block_hash = self._hasher.block_hash(hashes[-1] if i else b"", tokens, level_extra)
            host_id = self.host.find(block_hash, tokens, level_extra, parent_key)
            if host_id is None:
                break
            host_ids.append(host_id)
            hashes.append(block_hash)
            parent_key = self.host.key(host_id)
        if not host_ids:
            return hit
        return PrefixHit(hit.block_ids, tuple(hashes), len(hashes) * bs, cache_salt, adapter_id,
                         tuple(host_ids))

    def allocate(self, seq_id: Hashable, num_tokens: int, hit: PrefixHit | None = None, *,
                 final_num_tokens: int | None = None, cache_salt: str | None = None,
                 adapter_id: str | int | None = None) -> bool:
        """``BlockAllocator.allocate``; a hit's host blocks are copied into the first fresh
        blocks (this step's swap-ins) and count as computed and as prefix hits."""
        if hit is None or not hit.host_block_ids:
            return super().allocate(seq_id, num_tokens, hit, final_num_tokens=final_num_tokens,
                                    cache_salt=cache_salt, adapter_id=adapter_id)
        if seq_id in self._seqs or seq_id in self._swapped:
            raise AllocationError(f"seq_id {seq_id!r} is already allocated")
        if ((cache_salt is not None and cache_salt != hit.cache_salt) or
                (adapter_id is not None and adapter_id != hit.adapter_id)):
            raise ValueError("cache_salt/adapter_id differ from those the hit was looked up with")
        num_device = len(hit.block_ids)
        for host_id, block_hash in zip(hit.host_block_ids, hit.block_hashes[num_device:],
                                       strict=True):
            key = self.host.key(host_id) if 0 <= host_id < self.host.num_blocks else None
            if key is None or key[_HASH] != block_hash:
                raise AllocationError(f"stale prefix hit: host block {host_id} no longer holds "
                                      "the hashed content; call lookup() right before allocate()")
        if num_tokens < hit.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} < hit.num_tokens={hit.num_tokens}")
        device_hit = PrefixHit(hit.block_ids, hit.block_hashes[:num_device],
                               num_device * self.block_size, hit.cache_salt, hit.adapter_id)
        if not self.can_allocate(num_tokens, device_hit, final_num_tokens):
            return False
        for host_id in hit.host_block_ids:  # before fresh device blocks evict into the host
            self.host.pin(host_id)
        super().allocate(seq_id, num_tokens, device_hit, final_num_tokens=final_num_tokens)
        seq = self._seqs[seq_id]
        for host_id, device_id in zip(hit.host_block_ids, seq.block_table[num_device:],
                                      strict=False):
            self._install_key(device_id, self.host.key(host_id))
            self._swap_in_plan.append((host_id, device_id))
        host_tokens = hit.num_tokens - device_hit.num_tokens
        seq.num_computed_tokens = hit.num_tokens
        seq.block_hashes.extend(hit.block_hashes[num_device:])
        self._num_hit_tokens += host_tokens
        self._num_host_hit_tokens += host_tokens
        return True

    def _install_key(self, block_id: int, key: _BlockKey) -> None:
        self._block_key[block_id] = key
        self._hash_to_blocks.setdefault(key[_HASH], {})[block_id] = None

    def _device_copy(self, key: _BlockKey | None) -> int | None:
        """A device block (live or cached) holding the content ``key`` stands for."""
        if key is None or not self.enable_prefix_caching:
            return None
        return match_block(self._hash_to_blocks.get(key[_HASH], ()), self._block_key,
                           key[_TOKENS], key[_EXTRA], key[_PARENT])

    # ---------------------------------------------------------------- swapping

    def _swap_sources(self, seqs: Sequence[tuple[Hashable, int]],
                      pending_copies: dict[int, int]) -> tuple[list[list[int]], dict[int, int]]:
        """Per sequence, the device blocks its kept tokens are read from; and each distinct
        one with the number of table entries reading it."""
        incoming = {device_id for _, device_id in self._swap_in_plan}
        tables, counts = [], {}
        for seq_id, keep in seqs:
            seq = self._seq(seq_id)
            if not 0 <= keep <= seq.num_computed_tokens:
                raise ValueError(f"seq {seq_id!r}: tokens to keep must be in [0, "
                                 f"{seq.num_computed_tokens}], got {keep}")
            table = [pending_copies.get(b, b)
                     for b in seq.block_table[:-(-keep // self.block_size)]]
            for block_id in table:
                if block_id in incoming:
                    raise AllocationError(f"seq {seq_id!r}: block {block_id} is filled by this "
                                          "step's swap-ins, which run after its swap-outs")
                counts[block_id] = counts.get(block_id, 0) + 1
            tables.append(table)
        return tables, counts

    def blocks_to_swap_out(self, seqs: Sequence[tuple[Hashable, int]],
                           pending_copies: dict[int, int] | None = None) -> int:
        """Distinct device blocks ``swap_out`` would read for these sequences."""
        return len(self._swap_sources(seqs, pending_copies or {})[1])

    def window_blocks_to_swap_out(self, seqs: Sequence[tuple[Hashable, int]]) -> int:
        """Distinct window-group blocks ``swap_out`` would read (none here: one group)."""
        return 0

    def swap_out(self, seqs: Sequence[tuple[Hashable, int]],
                 pending_copies: dict[int, int] | None = None) -> bool:
        """Move the sequences, each as ``(seq_id, tokens to keep)`` (at most its computed
        tokens), to the host tier. ``pending_copies`` maps the destination of a copy-on-write
        copy not made yet to its source. A block this step's swap-ins fill cannot be read
        (swap-outs run first): swap out before swapping in or allocating with host hits, as
        the scheduler does (it preempts before it admits). All or nothing: returns False,
        changing nothing, when there is nothing to keep or the host pool lacks room."""
        plan = self._plan_swap_out(seqs, pending_copies or {})
        if plan is None:
            return False
        self._apply_swap_out(seqs, plan)
        return True

    def _plan_swap_out(self, seqs: Sequence[tuple[Hashable, int]],
                       pending_copies: dict[int, int]
                       ) -> tuple[list[list[int]], dict[int, int], dict[int, int]] | None:
        """``swap_out``'s checks, changing nothing: (per sequence the device blocks read,
        each distinct one's table entries, those whose content the host holds already ->
        that host block), or None where it must refuse."""
        tables, counts = self._swap_sources(seqs, pending_copies)
        found = {b: self.host.find_key(self._block_key[b]) for b in counts
                 if self._block_key[b] is not None}
        found = {b: h for b, h in found.items() if h is not None}
        cached = sum(1 for h in set(found.values()) if self.host.is_cached(h))
        if not counts or len(counts) - len(found) > self.host.num_available - cached:
            return None
        return tables, counts, found

    def _apply_swap_out(self, seqs: Sequence[tuple[Hashable, int]],
                        plan: tuple[list[list[int]], dict[int, int], dict[int, int]]) -> None:
        tables, counts, found = plan
        host_of = self.host.place(counts, found, self._block_key.__getitem__,
                                  self._swap_out_plan)
        bs = self.block_size
        for (seq_id, keep), table in zip(seqs, tables, strict=True):
            seq = self._seqs[seq_id]
            self._swapped[seq_id] = _SwappedSequence(
                [host_of[b] for b in table], keep, seq.block_hashes[:keep // bs], seq.extra,
                seq.cache_salt, seq.adapter_id)
            self.free(seq_id)

    def swap_in(self, seqs: Sequence[tuple[Hashable, int, int | None]]) -> bool:
        """Bring swapped-out sequences back, each as ``(seq_id, num_tokens,
        final_num_tokens)`` with ``allocate``'s meaning (the table covers ``num_tokens``, or
        the policy's reservation). All or nothing: returns False, changing nothing, when
        the device pool is short."""
        bs = self.block_size
        plans, reuse, fresh = [], {}, 0  # reuse: full host block -> device copy or None
        for seq_id, num_tokens, final_num_tokens in seqs:
            record = self._swapped.get(seq_id)
            if record is None:
                raise AllocationError(f"seq_id {seq_id!r} is not swapped out")
            self._check_len("num_tokens", num_tokens)
            if num_tokens < record.num_computed_tokens:
                raise ValueError(f"num_tokens={num_tokens} < its {record.num_computed_tokens} "
                                 "computed tokens")
            target = num_tokens
            if self.policy != "paged":
                if final_num_tokens is None or final_num_tokens < num_tokens:
                    raise ValueError(f"policy {self.policy!r} needs final_num_tokens >= "
                                     f"num_tokens={num_tokens}, got {final_num_tokens}")
                self._check_len("final_num_tokens", final_num_tokens)
                target = self.reserved_tokens(final_num_tokens)
            num_full = record.num_computed_tokens // bs
            for host_id in record.host_table[:num_full]:
                if host_id not in reuse:
                    reuse[host_id] = self._device_copy(self.host.key(host_id))
                    fresh += reuse[host_id] is None
            fresh += len(record.host_table) - num_full  # a partly filled block: one copy each
            fresh += -(-target // bs) - len(record.host_table)
            plans.append((seq_id, record, target))
        reused = {b for b in reuse.values() if b is not None}
        if fresh > self.num_free_blocks - sum(1 for b in reused if self._ref_count[b] == 0):
            return False
        for block_id in reused:  # out of the LRU before fresh blocks are taken
            if self._ref_count[block_id] == 0:
                del self._cached_free[block_id]
        copied: dict[int, int] = {}  # full host block -> its fresh device block
        for seq_id, record, target in plans:
            table = []
            for i, host_id in enumerate(record.host_table):
                full = i < record.num_computed_tokens // bs
                block_id = None
                if full:
                    block_id = reuse[host_id]
                    block_id = copied.get(host_id) if block_id is None else block_id
                if block_id is None:
                    block_id = self._take_free_block()  # count 1
                    self._swap_in_plan.append((host_id, block_id))
                    self.host.pin(host_id)
                    if full:
                        copied[host_id] = block_id
                        key = self.host.key(host_id)
                        if key is not None:
                            self._install_key(block_id, key)
                else:
                    self._ref_count[block_id] += 1
                table.append(block_id)
            table += [self._take_free_block() for _ in range(-(-target // bs) - len(table))]
            del self._swapped[seq_id]
            for host_id in record.host_table:
                self.host.release(host_id)
            self._seqs[seq_id] = _Sequence(table, record.num_computed_tokens,
                                           record.block_hashes, record.extra,
                                           record.cache_salt, record.adapter_id)
        return True

    def drop_swapped(self, seq_id: Hashable) -> None:
        """Forget a swapped-out sequence (it finished, or recomputes): its host blocks are
        released."""
        record = self._swapped.pop(seq_id, None)
        if record is None:
            raise AllocationError(f"seq_id {seq_id!r} is not swapped out")
        for host_id in record.host_table:
            self.host.release(host_id)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return seq_id in self._swapped

    def swapped_table(self, seq_id: Hashable) -> list[int]:
        """A copy of a swapped-out sequence's host table."""
        return list(self._swapped[seq_id].host_table)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's copies, ``(device block, host block)`` out and ``(host block, device
        block)`` in; ends the step (host blocks read by it may be handed out again)."""
        swap_out = [(device_id, host_id) for host_id, device_id in self._swap_out_plan.items()]
        swap_in, self._swap_in_plan, self._swap_out_plan = self._swap_in_plan, [], {}
        self.host.end_step()
        return swap_out, swap_in

    def pool_lost(self, unwritten: Sequence[int]) -> list[Hashable]:
        """The device pool was lost with no sequence left on it: forget the device prefix
        cache and every host block in ``unwritten`` (its swap-out never ran). Returns the
        swapped-out sequences that held such a block, now dropped: they must recompute.
        The rest of the host tier stays valid."""
        if self._seqs:
            raise AllocationError("pool_lost with sequences still on the device")
        super().reset_prefix_cache()
        lost = set(unwritten)
        dropped = [s for s, record in self._swapped.items() if lost.intersection(record.host_table)]
        for seq_id in dropped:
            self.drop_swapped(seq_id)
        for host_id in lost:
            self.host.invalidate(host_id)
        return dropped

    def reset_prefix_cache(self) -> bool:
        """Drop every hash of both tiers; refused (False) while any block of either is held."""
        if self._swapped or not super().reset_prefix_cache():
            return False
        self.host.reset()
        return True

    # ---------------------------------------------------------------- queries

    def usage(self) -> dict[str, float | int]:
        """The device pool's usage, the host pool's (``host_*`` blocks), and the tokens of
        prefix hits served by the host tier (also counted in ``prefix_cache_hits``)."""
        return {**super().usage(), **self.host.usage(),
                "prefix_cache_host_hits": self._num_host_hit_tokens}

    def check_invariants(self) -> None:
        super().check_invariants()
        bs, held = self.block_size, [0] * self.host.num_blocks
        for seq_id, record in self._swapped.items():
            table, computed = record.host_table, record.num_computed_tokens
            assert seq_id not in self._seqs, f"seq {seq_id!r} both live and swapped out"
            assert len(table) == -(-computed // bs) and len(set(table)) == len(table), (
                f"swapped seq {seq_id!r}: host table {table} for {computed} tokens")
            if self.enable_prefix_caching:
                assert len(record.block_hashes) == computed // bs, f"{seq_id!r}: hash count"
                for host_id, block_hash in zip(table, record.block_hashes, strict=False):
                    key = self.host.key(host_id)
                    assert key is not None and key[_HASH] == block_hash, (
                        f"swapped seq {seq_id!r}: full host block {host_id} not keyed as its seq")
            for host_id in table:
                held[host_id] += 1
        self.host.check_invariants(held)
