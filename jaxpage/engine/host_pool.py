"""The host tier's block bookkeeping: which host-pool block holds what (plain Python, no JAX).

The runner keeps the host pool's contents (a numpy array, one row per block); this class
says which rows are in use. Host blocks are numbered ``0 .. num_blocks - 1`` (no null block:
nothing pads into the host pool). Each block is in exactly one state:

* free -- ``_free``, a FIFO of blocks holding nothing;
* cached -- ``_cached``, an LRU (least recently used first) of full blocks with a key and a
  ref count of 0: blocks evicted from the device pool's prefix cache, or left behind by a
  swapped-out sequence that came back. Taking a block when ``_free`` is empty evicts the LRU;
* held -- by swapped-out sequences (``_ref_count`` counts their table entries) or pinned.

Keys are the device allocator's block keys (``block_hashing``): a block found through
``find`` matches the query's tokens, extra keys and whole prefix, so salts and colliding
hashes are as safe in this tier as on the device. A held block may carry a key too (a full
block of a swapped-out sequence); with ``caching`` it is in the hash map, so it can be hit
and an eviction of the same content from the device costs no copy.

Pins: the device runs a step's host writes (swap-outs) before its host reads (swap-ins),
so a block read this step (``pin``) must not be handed to a write in the same step; it
stays held until ``end_step``. Across steps the device works in order (a failed step's
transfers go first in the next one), so a pin never needs to outlive its step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from jaxpage.engine.block_hashing import _EXTRA, _HASH, _PARENT, _TOKENS, _BlockKey, match_block


class HostBlockPool:
    """Free / cached / held host blocks, their ref counts and keys, the host hash map."""

    def __init__(self, num_blocks: int, *, caching: bool) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caching = caching and num_blocks > 0
        self._ref_count = [0] * num_blocks
        self._key: list[_BlockKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_blocks: dict[bytes, dict[int, None]] = {}
        self._pinned: dict[int, None] = {}  # read by this step's swap-ins, in pin order

    @property
    def num_available(self) -> int:
        """Blocks ``take`` can hand out now: free + cached."""
        return len(self._free) + len(self._cached)

    def key(self, block_id: int) -> _BlockKey | None:
        return self._key[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is in the cache (free to be evicted by ``take``)."""
        return block_id in self._cached

    def take(self, key: _BlockKey | None, ref_count: int) -> int | None:
        """A block for new content (free first, else the LRU cached one, whose content is
        dropped), or None when every block is held. With ``ref_count`` 0 it enters the
        cache (it must then carry a key); else it is held by that many table entries."""
        if self._free:
            block_id = self._free.popleft()
        elif self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._unregister(block_id)
        else:
            return None
        self._ref_count[block_id] = ref_count
        self._key[block_id] = key
        if key is not None and self.caching:
            self._hash_to_blocks.setdefault(key[_HASH], {})[block_id] = None
        if ref_count == 0:
            self._cached[block_id] = None
        return block_id

    def place(self, counts: dict[int, int], found: dict[int, int],
              key_of: Callable[[int], _BlockKey | None], copies: dict[int, int]
              ) -> dict[int, int]:
        """The host block of each device block of a swap-out, held by ``counts[device]``
        table entries: the one ``found`` holding its content already (held again first:
        taking new blocks may evict it), else a new one for ``key_of(device)``, whose copy
        ``copies`` records (host block -> device block)."""
        host_of = {}
        for device_id, host_id in found.items():
            self.hold(host_id, counts[device_id])
            host_of[device_id] = host_id
        for device_id, count in counts.items():
            if device_id not in host_of:
                host_id = self.take(key_of(device_id), count)
                copies[host_id] = device_id
                host_of[device_id] = host_id
        return host_of

    def hold(self, block_id: int, count: int) -> None:
        """``count`` more table entries hold the block (a cached one leaves the cache)."""
        self._cached.pop(block_id, None)
        self._ref_count[block_id] += count

    def release(self, block_id: int) -> None:
        """One table entry lets go of the block."""
        self._ref_count[block_id] -= 1
        self._settle(block_id)

    def pin(self, block_id: int) -> None:
        """Hold the block until ``end_step``: this step's swap-ins read it."""
        self._cached.pop(block_id, None)
        self._pinned[block_id] = None

    def end_step(self) -> None:
        """The step's plan is complete: pinned blocks nobody holds go back to the cache
        (most recently used) or the free queue."""
        pinned, self._pinned = self._pinned, {}
        for block_id in pinned:
            self._settle(block_id)

    def _settle(self, block_id: int) -> None:
        if self._ref_count[block_id] or block_id in self._pinned:
            return
        if self.caching and self._key[block_id] is not None:
            self._cached[block_id] = None
        else:
            self._unregister(block_id)
            self._free.append(block_id)

    def _unregister(self, block_id: int) -> None:
        key, self._key[block_id] = self._key[block_id], None
        if key is None or not self.caching:
            return
        bucket = self._hash_to_blocks[key[_HASH]]
        del bucket[block_id]
        if not bucket:
            del self._hash_to_blocks[key[_HASH]]

    def find(self, block_hash: bytes, tokens: tuple[int, ...], extra: bytes,
             parent_key: _BlockKey | None) -> int | None:
        """The cached or held block with exactly this content (see ``match_block``)."""
        if not self.caching:
            return None
        return match_block(self._hash_to_blocks.get(block_hash, ()), self._key, tokens, extra,
                           parent_key)

    def find_key(self, key: _BlockKey) -> int | None:
        """The block holding the content ``key`` stands for, if any."""
        return self.find(key[_HASH], key[_TOKENS], key[_EXTRA], key[_PARENT])

    def touch(self, block_id: int) -> None:
        """Mark a cached block most recently used."""
        if block_id in self._cached:
            self._cached.move_to_end(block_id)

    def invalidate(self, block_id: int) -> None:
        """The block never received its content: forget its key; unless held, free it."""
        self._unregister(block_id)
        if block_id in self._cached:
            del self._cached[block_id]
            self._free.append(block_id)

    def reset(self) -> None:
        """Forget every cached block (held ones stay)."""
        for block_id in self._cached:
            self._unregister(block_id)
            self._free.append(block_id)
        self._cached.clear()

    def usage(self) -> dict[str, int]:
        free, cached = len(self._free), len(self._cached)
        return {"host_blocks": self.num_blocks, "host_used": self.num_blocks - free - cached,
                "host_cached": cached, "host_free": free}

    def check_invariants(self, held: list[int]) -> None:
        """Assert the states partition the blocks; ``held[b]`` is the number of swapped-out
        table entries holding block ``b`` (counted by the caller)."""
        assert self._ref_count == held, "host ref counts: " + str(
            [(b, r, h) for b, (r, h) in enumerate(zip(self._ref_count, held, strict=True))
             if r != h][:5])
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "duplicate in the host free queue"
        assert not free & cached, "host block both free and cached"
        for block_id in free:
            assert not held[block_id] and block_id not in self._pinned, f"free {block_id} held"
            assert self._key[block_id] is None, f"free host block {block_id} has a key"
        for block_id in cached:
            assert not held[block_id] and block_id not in self._pinned, f"cached {block_id} held"
            assert self._key[block_id] is not None and self.caching, f"cached {block_id} keyless"
        in_use = {b for b in range(self.num_blocks) if held[b] or b in self._pinned}
        assert not in_use & (free | cached), "held host block in a free structure"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "host conservation"
        entries = 0
        for block_hash, bucket in self._hash_to_blocks.items():
            assert bucket, "empty host hash bucket"
            for block_id in bucket:
                key = self._key[block_id]
                assert key is not None and key[_HASH] == block_hash, f"host map -> {block_id}"
            entries += len(bucket)
        keyed = sum(1 for key in self._key if key is not None)
        assert not self.caching or entries == keyed, f"{keyed} keyed host blocks, {entries} mapped"
        assert self.caching or not self._hash_to_blocks, "host map without caching"
