"""Tests for the host block allocator: a state machine against a naive model, plus hand-worked
cases with exact block ids."""

from __future__ import annotations

import ast
import hashlib
import pathlib
import subprocess
import sys

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpage.engine.block_allocator import AllocationError, BlockAllocator, PrefixHit
from jaxpage.engine.tiered_allocator import TieredAllocator

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULE_PATHS = [REPO_ROOT / "jaxpage" / "engine" / name
                for name in ("block_allocator.py", "block_hashing.py", "host_pool.py",
                             "tiered_allocator.py")]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def snapshot(alloc: BlockAllocator) -> tuple:
    """Everything an allocator holds, as plain values (white-box: for no-change checks)."""
    keys = [None if k is None else (k[0], k[1], k[3]) for k in alloc._block_key]  # no parent
    seqs = {s: (list(q.block_table), q.num_computed_tokens, list(q.block_hashes), q.extra)
            for s, q in alloc._seqs.items()}
    return (list(alloc._free), list(alloc._cached_free), list(alloc._ref_count), keys,
            {h: list(b) for h, b in alloc._hash_to_blocks.items()}, seqs, alloc.usage())


# --------------------------------------------------------------------------- naive model


class NaiveAllocator:
    """The documented semantics with plain lists and linear scans.

    A hashed block is identified by its full content: (salt, adapter, every token from position 0
    to the block's end). A lookup takes, per level, the earliest-registered block of that content.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks, self.bs, self.caching = num_blocks, block_size, caching
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.extra: dict[int, tuple] = {}
        self.content: dict[int, tuple] = {}  # hashed block -> (salt, adapter, prefix tokens)
        self.registered: dict[int, int] = {}  # hashed block -> registration number
        self.counter = 0
        self.free = list(range(1, num_blocks))  # FIFO of never-hashed free blocks
        self.lru: list[int] = []  # cached free blocks, least recently used first
        self.queries = self.hits = 0

    def refcount(self, block: int) -> int:
        return sum(table.count(block) for table in self.tables.values())

    def lookup(self, tokens, salt, adapter) -> list[int]:
        if not self.caching:
            return []
        found = []
        for i in range((len(tokens) - 1) // self.bs):
            want = (salt, adapter, tuple(tokens[:(i + 1) * self.bs]))
            candidates = [b for b, c in self.content.items() if c == want]
            if not candidates:
                break
            found.append(min(candidates, key=self.registered.__getitem__))
        return found

    def take(self) -> int:
        if self.free:
            return self.free.pop(0)
        block = self.lru.pop(0)
        del self.content[block], self.registered[block]
        return block

    def allocate(self, seq, num_tokens, hit, salt, adapter) -> bool:
        need = ceil_div(num_tokens, self.bs) - len(hit)
        if need > len(self.free) + len([b for b in self.lru if b not in hit]):
            return False
        self.lru = [b for b in self.lru if b not in hit]
        self.tables[seq] = list(hit) + [self.take() for _ in range(need)]
        self.computed[seq] = len(hit) * self.bs
        self.extra[seq] = (salt, adapter)
        if self.caching:
            self.queries += num_tokens
            self.hits += len(hit) * self.bs
        return True

    def grow(self, seq, num_tokens):
        table, computed = self.tables[seq], self.computed[seq]
        end = ceil_div(num_tokens, self.bs)
        write = range(computed // self.bs, min(end, len(table))) if num_tokens > computed else []
        cow = [i for i in write if self.refcount(table[i]) > 1]
        append = max(0, end - len(table))
        if len(cow) + append > len(self.free) + len(self.lru):
            return None
        copies = []
        for i in cow:
            new = self.take()
            if computed > i * self.bs:
                copies.append((table[i], new))
            table[i] = new
        table.extend(self.take() for _ in range(append))
        return copies

    def commit(self, seq, tokens) -> None:
        table, old = self.tables[seq], self.computed[seq]
        self.computed[seq] = len(tokens)
        if self.caching:
            for i in range(old // self.bs, len(tokens) // self.bs):
                self.content[table[i]] = (*self.extra[seq], tuple(tokens[:(i + 1) * self.bs]))
                self.registered[table[i]] = self.counter
                self.counter += 1

    def fork(self, parent, child) -> None:
        self.tables[child] = list(self.tables[parent])
        self.computed[child] = self.computed[parent]
        self.extra[child] = self.extra[parent]

    def free_seq(self, seq) -> None:
        table = self.tables.pop(seq)
        del self.computed[seq], self.extra[seq]
        for block in reversed(table):
            if self.refcount(block) == 0:
                (self.lru if block in self.content else self.free).append(block)

    def reset(self) -> bool:
        if any(self.tables.values()):
            return False
        self.free.extend(self.lru)
        self.lru, self.content, self.registered = [], {}, {}
        return True


# --------------------------------------------------------------------------- state machine

TOKENS = st.integers(0, 1)  # tiny vocabulary so prefixes repeat
SALTS = st.sampled_from([None, None, None, "a"])
ADAPTERS = st.sampled_from([None, None, None, "a", 1])


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/grow/commit/fork/free/lookup/reset against NaiveAllocator.

    A simulated KV pool (tokens per slot) is written on commit and copied on copy-on-write, so
    every step checks that each live sequence reads its own tokens back through its table.
    """

    caching = True
    hash_fn = None
    salts, adapters = SALTS, ADAPTERS

    @initialize(num_blocks=st.integers(6, 12), block_size=st.integers(2, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.alloc = self.new_allocator(num_blocks, block_size)
        self.model = NaiveAllocator(num_blocks, block_size, self.caching)
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[int, list[int]] = {}  # live seq -> its tokens (computed and future)
        self.corpus: list[tuple[list[int], str | None, str | int | None]] = []
        self.last_freed: tuple[list[int], str | None, str | int | None] | None = None
        self.next_id = 0

    def new_allocator(self, num_blocks: int, block_size: int) -> BlockAllocator:
        return BlockAllocator(num_blocks, block_size, enable_prefix_caching=self.caching,
                              hash_fn=self.hash_fn)

    def draw_seq(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="seq")

    def draw_prompt(self, data):
        tail = data.draw(st.lists(TOKENS, min_size=0, max_size=3 * self.bs), label="tail")
        if self.corpus and data.draw(st.integers(0, 3), label="reuse") > 0:
            recent = st.sampled_from(self.corpus[-3:])  # most likely still cached
            base, salt, adapter = data.draw(recent | st.sampled_from(self.corpus), label="base")
            cut = data.draw(st.just(len(base)) | st.integers(0, len(base)), label="cut")
            if data.draw(st.booleans(), label="same keys"):
                return base[:cut] + tail or [0], salt, adapter
            return base[:cut] + tail or [0], data.draw(self.salts), data.draw(self.adapters)
        return tail or [0], data.draw(self.salts), data.draw(self.adapters)

    def lookup_both(self, prompt, salt, adapter) -> PrefixHit:
        hit = self.alloc.lookup(prompt, cache_salt=salt, adapter_id=adapter)
        expected = self.model.lookup(prompt, salt, adapter)
        assert list(hit.block_ids) == expected, (prompt, salt, adapter)
        assert hit.num_tokens == len(expected) * self.bs
        return hit

    def allocate_both(self, prompt, salt, adapter, hit: PrefixHit, num_tokens: int) -> bool:
        seq, before = self.next_id, snapshot(self.alloc)
        self.next_id += 1
        can = self.alloc.can_allocate(num_tokens, hit)
        ok = self.alloc.allocate(seq, num_tokens, hit)
        assert ok == can == self.model.allocate(seq, num_tokens, hit.block_ids, salt, adapter)
        if ok:
            self.tokens[seq] = list(prompt)
            self.corpus.append((list(prompt), salt, adapter))
        else:
            assert snapshot(self.alloc) == before
        return ok

    def grow_both(self, seq: int, num_tokens: int) -> list[tuple[int, int]] | None:
        computed, before = self.alloc.num_computed_tokens(seq), snapshot(self.alloc)
        copies = self.alloc.grow(seq, num_tokens)
        assert copies == self.model.grow(seq, num_tokens)
        if copies is None:
            assert snapshot(self.alloc) == before
            return None
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        table = self.alloc.block_table(seq)
        assert len(table) * self.bs >= num_tokens
        if num_tokens > computed:
            for i in range(computed // self.bs, ceil_div(num_tokens, self.bs)):
                assert self.alloc.ref_count(table[i]) == 1, "write range must be exclusive"
        return copies

    @rule(data=st.data(), chunk=st.integers(1, 12))
    def allocate(self, data, chunk: int) -> None:
        prompt, salt, adapter = self.draw_prompt(data)
        hit = self.lookup_both(prompt, salt, adapter)
        num_tokens = min(len(prompt), hit.num_tokens + chunk)  # chunked prefill
        if self.allocate_both(prompt, salt, adapter, hit, num_tokens) and data.draw(
                st.integers(0, 3), label="prefill now") > 0:
            self.commit_both(data, self.next_id - 1, num_tokens)

    @rule(data=st.data(), over=st.booleans(), slack=st.integers(0, 3))
    def allocate_at_capacity(self, data, over: bool, slack: int) -> None:
        """Ask for exactly the blocks left (or one more), minus the hit's own cached-free ones."""
        if self.last_freed and data.draw(st.booleans(), label="rerun last freed"):
            prompt, salt, adapter = self.last_freed  # its blocks are likely cached-free
            prompt = prompt + data.draw(st.lists(TOKENS, max_size=self.bs), label="tail")
        else:
            prompt, salt, adapter = self.draw_prompt(data)
        hit = self.lookup_both(prompt, salt, adapter)
        hit_free = sum(1 for b in hit.block_ids if self.alloc.ref_count(b) == 0)
        fresh = self.alloc.num_free_blocks - hit_free + over
        if fresh < 1:
            return
        num_tokens = (len(hit.block_ids) + fresh) * self.bs - min(slack, self.bs - 1)
        assert self.allocate_both(prompt, salt, adapter, hit, num_tokens) == (not over)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 6))
    def grow(self, data, extra: int) -> None:
        seq = self.draw_seq(data)
        self.grow_both(seq, self.alloc.num_computed_tokens(seq) + extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), over=st.booleans())
    def grow_at_capacity(self, data, over: bool) -> None:
        """Grow so copy-on-write + appended blocks need exactly the free blocks (or one more)."""
        seq = self.draw_seq(data)
        table, computed = self.alloc.block_table(seq), self.alloc.num_computed_tokens(seq)
        shared = sum(1 for b in table[computed // self.bs:] if self.alloc.ref_count(b) > 1)
        append = self.alloc.num_free_blocks - shared + over
        num_tokens = (len(table) + append) * self.bs
        if append < 0 or num_tokens <= computed:
            return
        assert (self.grow_both(seq, num_tokens) is None) == over

    def commit_both(self, data, seq: int, n: int) -> None:
        """Write and commit the sequence's first ``n`` tokens (decoding random ones if needed)."""
        table, computed = self.alloc.block_table(seq), self.alloc.num_computed_tokens(seq)
        tokens = self.tokens[seq]
        if len(tokens) < n:
            tokens += data.draw(st.lists(TOKENS, min_size=n - len(tokens),
                                         max_size=n - len(tokens)), label="decoded")
        blocks = range(computed // self.bs, ceil_div(n, self.bs)) if n > computed else []
        if any(self.alloc.ref_count(table[i]) > 1 for i in blocks):
            before = snapshot(self.alloc)
            with pytest.raises(AllocationError):
                self.alloc.commit(seq, tokens[:n])
            assert snapshot(self.alloc) == before
            return
        self.alloc.commit(seq, tokens[:n])
        self.model.commit(seq, tokens[:n])
        for pos in range(computed, n):
            self.kv[table[pos // self.bs]][pos % self.bs] = tokens[pos]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 6))
    def commit(self, data, k: int) -> None:
        seq = self.draw_seq(data)
        capacity = len(self.alloc.block_table(seq)) * self.bs
        self.commit_both(data, seq, min(self.alloc.num_computed_tokens(seq) + k, capacity))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent, child = self.draw_seq(data), self.next_id
        self.next_id += 1
        self.alloc.fork(parent, child)
        self.model.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = self.draw_seq(data)
        self.last_freed = (self.tokens[seq][:self.alloc.num_computed_tokens(seq)],
                           *self.model.extra[seq])
        self.corpus.append(self.last_freed)
        self.alloc.free(seq)
        self.model.free_seq(seq)
        del self.tokens[seq]

    @rule(data=st.data())
    def lookup(self, data) -> None:
        self.lookup_both(*self.draw_prompt(data))

    @rule()
    def reset(self) -> None:
        assert self.alloc.reset_prefix_cache() == self.model.reset()

    @invariant()
    def matches_model(self) -> None:
        alloc, model = self.alloc, self.model
        alloc.check_invariants()
        for seq, tokens in self.tokens.items():
            table, computed = alloc.block_table(seq), alloc.num_computed_tokens(seq)
            assert table == model.tables[seq] and computed == model.computed[seq], seq
            read = [self.kv[table[p // self.bs]][p % self.bs] for p in range(computed)]
            assert read == tokens[:computed], f"seq {seq} reads wrong KV through its table"
        assert [alloc.ref_count(b) for b in range(alloc.num_blocks)] == [
            model.refcount(b) for b in range(model.num_blocks)]
        assert list(alloc._free) == model.free
        assert list(alloc._cached_free) == model.lru
        assert {b for b, key in enumerate(alloc._block_key) if key} == set(model.content)
        usage = alloc.usage()
        assert (usage["free"], usage["cached_free"]) == (len(model.free), len(model.lru))
        assert alloc.num_free_blocks == len(model.free) + len(model.lru)
        assert (usage["prefix_cache_queries"], usage["prefix_cache_hits"]) == (
            model.queries, model.hits)


class ConstantHashMachine(AllocatorMachine):
    """Every block hashes alike: hits must still match exact content (and extra keys)."""

    hash_fn = staticmethod(lambda data: b"\x00" * 8)
    salts, adapters = st.sampled_from([None, "a"]), st.sampled_from([None, "a", 1])


class OneByteHashMachine(AllocatorMachine):
    """Frequent partial collisions (256 buckets)."""

    hash_fn = staticmethod(lambda data: hashlib.sha256(data).digest()[:1])


class NoCachingMachine(AllocatorMachine):
    caching = False


class NoHostTierMachine(AllocatorMachine):
    """The allocator every engine without swap_space runs: a TieredAllocator with no host
    blocks is the device allocator, block id for block id."""

    def new_allocator(self, num_blocks: int, block_size: int) -> BlockAllocator:
        return TieredAllocator(num_blocks, block_size, num_host_blocks=0, hash_fn=self.hash_fn)


def _case(machine: type[RuleBasedStateMachine], examples: int):
    machine.TestCase.settings = settings(
        max_examples=examples, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    return machine.TestCase


TestAllocatorMachine = _case(AllocatorMachine, 300)
TestConstantHashMachine = _case(ConstantHashMachine, 150)
TestOneByteHashMachine = _case(OneByteHashMachine, 100)
TestNoCachingMachine = _case(NoCachingMachine, 60)
TestNoHostTierMachine = _case(NoHostTierMachine, 60)


# --------------------------------------------------------------------------- two tiers


def tiered_snapshot(alloc: TieredAllocator) -> tuple:
    """Both tiers' state as plain values (white-box: for no-change checks)."""
    host = alloc.host
    swapped = {s: (list(r.host_table), r.num_computed_tokens, list(r.block_hashes))
               for s, r in alloc._swapped.items()}
    return (snapshot(alloc), list(host._free), list(host._cached), list(host._ref_count),
            [None if k is None else k[0] for k in host._key], list(host._pinned), swapped,
            dict(alloc._swap_out_plan), list(alloc._swap_in_plan))


class TieredMachine(RuleBasedStateMachine):
    """The allocator with a host tier, driven as the scheduler drives it: allocations with
    hits in either tier, grow (copy-on-write), commit, fork, free, swap out / swap in of
    groups of sequences, host-tier evictions (the device LRU evicting into a small host
    pool, the host LRU making room), lookups, resets.

    The oracle is a pair of simulated pools (a token per slot, plus the salt and adapter of
    the sequence that wrote each block), on which each step's swap-outs, swap-ins and
    copy-on-write copies are applied in the device's order at the step's end (a commit or a
    fork ends the step first: the engine writes K/V and forks after the step's device
    work). After every rule, with this step's work projected: both tiers' invariants hold,
    every live sequence reads its own tokens back through its table, every swapped-out one
    through its host table, and every prefix hit (device or host blocks) holds exactly the
    prompt's tokens, written under the query's salt and adapter.
    """

    hash_fn = None
    host_caching = True
    salts, adapters = SALTS, ADAPTERS

    @initialize(num_blocks=st.integers(5, 10), num_host_blocks=st.integers(1, 12),
                block_size=st.integers(2, 4))
    def setup(self, num_blocks: int, num_host_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.alloc = TieredAllocator(num_blocks, block_size, num_host_blocks=num_host_blocks,
                                     enable_host_prefix_cache=self.host_caching,
                                     hash_fn=self.hash_fn)
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.kv_owner = [None] * num_blocks  # (salt, adapter) of the block's writer
        self.host = [[None] * block_size for _ in range(num_host_blocks)]
        self.host_owner = [None] * num_host_blocks
        self.tokens: dict[int, list[int]] = {}  # live seq -> its tokens
        self.swapped: dict[int, list[int]] = {}  # swapped-out seq -> its kept tokens
        self.keys: dict[int, tuple] = {}  # seq -> (salt, adapter)
        self.copies: list[tuple[int, int]] = []  # this step's copy-on-write copies
        self.corpus: list[tuple[list[int], str | None, str | int | None]] = []
        self.freed: list[tuple[list[int], str | None, str | int | None]] = []
        self.next_id = self.host_hit_tokens = 0

    draw_prompt = AllocatorMachine.draw_prompt

    def draw_seqs(self, data, pool: dict) -> list[int]:
        return data.draw(st.lists(st.sampled_from(sorted(pool)), min_size=1, max_size=3,
                                  unique=True), label="seqs")

    def projected(self, swap_out=None, swap_in=None):
        """The pools after this step's device work: swap-outs, swap-ins, then copies."""
        if swap_out is None:
            swap_out = [(d, h) for h, d in self.alloc._swap_out_plan.items()]
            swap_in = self.alloc._swap_in_plan
        kv, kv_owner = [list(b) for b in self.kv], list(self.kv_owner)
        host, host_owner = [list(b) for b in self.host], list(self.host_owner)
        for device_id, host_id in swap_out:
            host[host_id], host_owner[host_id] = list(kv[device_id]), kv_owner[device_id]
        for host_id, device_id in swap_in:
            kv[device_id], kv_owner[device_id] = list(host[host_id]), host_owner[host_id]
        for src, dst in self.copies:
            kv[dst], kv_owner[dst] = list(kv[src]), kv_owner[src]
        return kv, kv_owner, host, host_owner

    def end_step(self) -> None:
        plan = ([(d, h) for h, d in self.alloc._swap_out_plan.items()],
                list(self.alloc._swap_in_plan))
        assert self.alloc.take_swaps() == plan
        self.kv, self.kv_owner, self.host, self.host_owner = self.projected(*plan)
        self.copies = []
        assert not self.alloc.host._pinned

    def lookup_checked(self, prompt, salt, adapter) -> PrefixHit:
        hit = self.alloc.lookup(prompt, cache_salt=salt, adapter_id=adapter)
        kv, kv_owner, host, host_owner = self.projected()
        blocks = ([(kv, kv_owner, b) for b in hit.block_ids]
                  + [(host, host_owner, h) for h in hit.host_block_ids])
        assert hit.num_tokens == len(blocks) * self.bs <= max(len(prompt) - 1, 0)
        assert self.host_caching or not hit.host_block_ids
        for i, (pool, owner, block_id) in enumerate(blocks):
            assert pool[block_id] == prompt[i * self.bs:(i + 1) * self.bs], (i, block_id)
            assert owner[block_id] == (salt, adapter), "a hit across salts or adapters"
        return hit

    @rule(data=st.data(), chunk=st.integers(1, 12))
    def allocate(self, data, chunk: int) -> None:
        self.allocate_prompt(*self.draw_prompt(data), chunk)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def revisit(self, data) -> None:
        """A finished sequence's tokens again (a returning conversation): its blocks may
        be cached on the device, in the host tier, or gone."""
        prompt, salt, adapter = data.draw(st.sampled_from(self.freed), label="freed")
        self.allocate_prompt(prompt + [1], salt, adapter, len(prompt) + 1)

    def allocate_prompt(self, prompt, salt, adapter, chunk: int) -> None:
        hit = self.lookup_checked(prompt, salt, adapter)
        num_tokens = min(len(prompt), hit.num_tokens + chunk)
        seq, before = self.next_id, tiered_snapshot(self.alloc)
        self.next_id += 1
        if not self.alloc.allocate(seq, num_tokens, hit):
            assert tiered_snapshot(self.alloc) == before
            return
        assert self.alloc.num_computed_tokens(seq) == hit.num_tokens
        self.tokens[seq], self.keys[seq] = list(prompt), (salt, adapter)
        self.corpus.append((list(prompt), salt, adapter))
        self.host_hit_tokens += len(hit.host_block_ids) * self.bs

    @rule(data=st.data(), keep=st.booleans())
    def fill_the_pool(self, data, keep: bool) -> None:
        """A prompt of every free device block, prefilled (and maybe finished): the device
        evicts its whole cache into the host tier, whose LRU makes room in turn."""
        free = self.alloc.num_free_blocks
        if free < 1:
            return
        prompt = data.draw(st.lists(TOKENS, min_size=free * self.bs, max_size=free * self.bs),
                           label="filler")
        seq = self.next_id
        self.next_id += 1
        assert self.alloc.allocate(seq, len(prompt))
        self.end_step()
        self.alloc.commit(seq, prompt)
        for pos, token in enumerate(prompt):
            block_id = self.alloc.block_table(seq)[pos // self.bs]
            self.kv[block_id][pos % self.bs] = token
            self.kv_owner[block_id] = (None, None)
        if keep:
            self.tokens[seq], self.keys[seq] = prompt, (None, None)
        else:
            self.alloc.free(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 6))
    def grow(self, data, extra: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        before = tiered_snapshot(self.alloc)
        copies = self.alloc.grow(seq, self.alloc.num_computed_tokens(seq) + extra)
        if copies is None:
            assert tiered_snapshot(self.alloc) == before
        else:
            self.copies += copies

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 6))
    def commit(self, data, k: int) -> None:
        self.end_step()
        seq = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        table, computed = self.alloc.block_table(seq), self.alloc.num_computed_tokens(seq)
        n = min(computed + k, len(table) * self.bs)
        if any(self.alloc.ref_count(table[i]) > 1
               for i in range(computed // self.bs, ceil_div(n, self.bs))):
            return  # needs grow() first (the base machine checks the refusal)
        tokens = self.tokens[seq]
        if len(tokens) < n:
            tokens += data.draw(st.lists(TOKENS, min_size=n - len(tokens),
                                         max_size=n - len(tokens)), label="decoded")
        self.alloc.commit(seq, tokens[:n])
        for pos in range(computed, n):
            block_id = table[pos // self.bs]
            self.kv[block_id][pos % self.bs] = tokens[pos]
            self.kv_owner[block_id] = self.keys[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        self.end_step()
        parent, child = data.draw(st.sampled_from(sorted(self.tokens)), label="seq"), self.next_id
        self.next_id += 1
        self.alloc.fork(parent, child)
        self.tokens[child], self.keys[child] = list(self.tokens[parent]), self.keys[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        table = self.alloc.block_table(seq)  # its copies are not made: its chunk is dropped
        self.copies = [(src, dst) for src, dst in self.copies if dst not in table]
        self.freed.append((self.tokens[seq][:self.alloc.num_computed_tokens(seq)],
                           *self.keys[seq]))
        self.corpus.append(self.freed[-1])
        self.alloc.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        seqs = self.draw_seqs(data, self.tokens)
        kept = [(s, data.draw(st.integers(0, self.alloc.num_computed_tokens(s)), label="keep"))
                for s in seqs]
        pending = {dst: src for src, dst in self.copies}
        tables = {seq: self.alloc.block_table(seq) for seq in seqs}
        before = tiered_snapshot(self.alloc)
        incoming = {d for _, d in self.alloc._swap_in_plan}  # filled after the swap-outs
        if any(pending.get(b, b) in incoming
               for seq, keep in kept for b in tables[seq][:ceil_div(keep, self.bs)]):
            with pytest.raises(AllocationError):
                self.alloc.swap_out(kept, pending)
            assert tiered_snapshot(self.alloc) == before
            return
        blocks = self.alloc.blocks_to_swap_out(kept, pending)
        available = self.alloc.host.num_available
        ok = self.alloc.swap_out(kept, pending)
        assert ok or blocks == 0 or blocks > available, "room on the host, yet no swap-out"
        if not ok:
            assert tiered_snapshot(self.alloc) == before
            return
        dropped = {b for table in tables.values() for b in table}  # their chunks' copies
        self.copies = [(src, dst) for src, dst in self.copies if dst not in dropped]
        for seq, keep in kept:
            self.swapped[seq] = self.tokens.pop(seq)[:keep]
            assert seq not in self.alloc and self.alloc.is_swapped(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        seqs = self.draw_seqs(data, self.swapped)
        plan = [(s, len(self.swapped[s]) + data.draw(st.integers(0, 3), label="new"), None)
                for s in seqs]
        host_tables = {s: self.alloc.swapped_table(s) for s in seqs}
        before = tiered_snapshot(self.alloc)
        if not self.alloc.swap_in(plan):
            assert tiered_snapshot(self.alloc) == before
            return
        device_of: dict[int, int] = {}  # full host block -> the device block it became
        for seq, num_tokens, _ in plan:
            self.tokens[seq] = self.swapped.pop(seq)
            table, computed = self.alloc.block_table(seq), self.alloc.num_computed_tokens(seq)
            assert computed == len(self.tokens[seq])
            assert len(table) == ceil_div(num_tokens, self.bs)
            for i, host_id in enumerate(host_tables[seq][:computed // self.bs]):
                assert device_of.setdefault(host_id, table[i]) == table[i], "sharing lost"

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def drop_swapped(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.swapped)), label="seq")
        self.alloc.drop_swapped(seq)
        del self.swapped[seq]

    @rule(data=st.data())
    def lookup(self, data) -> None:
        self.lookup_checked(*self.draw_prompt(data))

    @rule()
    def step(self) -> None:
        self.end_step()

    @rule(data=st.data())
    def lose_pool(self, data) -> None:
        """The device loses its pool in a step, before or after the step's swap-outs ran:
        every live sequence is freed (to recompute); so is every swapped-out one that holds a
        host block whose copy never arrived. The rest of the host tier stays valid."""
        swap_out, _ = self.alloc.take_swaps()
        ran = data.draw(st.booleans(), label="swap-outs ran")
        if ran:
            self.host, self.host_owner = self.projected(swap_out, [])[2:]
        unwritten = set() if ran else {host_id for _, host_id in swap_out}
        self.copies = []
        for seq in sorted(self.tokens):
            self.alloc.free(seq)
            self.freed.append((self.tokens.pop(seq), *self.keys[seq]))
        expected = {s for s in self.swapped if unwritten & set(self.alloc.swapped_table(s))}
        assert set(self.alloc.pool_lost(sorted(unwritten))) == expected
        for seq in expected:
            del self.swapped[seq]
        self.kv = [[None] * self.bs for _ in self.kv]
        self.kv_owner = [None] * len(self.kv)

    @rule()
    def reset(self) -> None:
        self.end_step()
        ok = self.alloc.reset_prefix_cache()
        # refused while any block is held: by a swapped-out sequence, or by a live one's table
        # (a live sequence may hold none: swapped out and back in before it had a token);
        # the tables' lengths are checked against the tokens where they are made
        held = self.swapped or any(self.alloc.block_table(seq) for seq in self.tokens)
        assert ok == (not held)
        if ok:
            assert self.alloc.usage()["cached_free"] == self.alloc.usage()["host_cached"] == 0

    @invariant()
    def pools_hold_what_the_tables_say(self) -> None:
        alloc = self.alloc
        alloc.check_invariants()
        kv, _, host, _ = self.projected()
        for seq, tokens in self.tokens.items():
            table, computed = alloc.block_table(seq), alloc.num_computed_tokens(seq)
            read = [kv[table[p // self.bs]][p % self.bs] for p in range(computed)]
            assert read == tokens[:computed], f"seq {seq} reads wrong KV through its table"
        for seq, tokens in self.swapped.items():
            table = alloc.swapped_table(seq)
            read = [host[table[p // self.bs]][p % self.bs] for p in range(len(tokens))]
            assert read == tokens, f"swapped seq {seq} reads wrong KV through its host table"
        assert alloc.usage()["prefix_cache_host_hits"] == self.host_hit_tokens


class TieredConstantHashMachine(TieredMachine):
    """Every block of both tiers hashes alike: hits must still match exact content."""

    hash_fn = staticmethod(lambda data: b"\x00" * 8)
    salts, adapters = st.sampled_from([None, "a"]), st.sampled_from([None, "a", 1])


class SwapOnlyMachine(TieredMachine):
    """A host pool for swapping only: no evicted blocks kept, no host hits."""

    host_caching = False


TestTieredMachine = _case(TieredMachine, 250)
TestTieredConstantHashMachine = _case(TieredConstantHashMachine, 100)
TestSwapOnlyMachine = _case(SwapOnlyMachine, 60)


# --------------------------------------------------------------------------- hand-worked cases


def committed(alloc: BlockAllocator, seq, tokens, **keys) -> list[int]:
    """Allocate ``tokens`` (with a prefix hit), commit all of them, return the table."""
    hit = alloc.lookup(tokens, **keys)
    assert alloc.allocate(seq, len(tokens), hit)
    alloc.commit(seq, tokens)
    alloc.check_invariants()
    return alloc.block_table(seq)


def test_initial_order_and_lru_eviction_order():
    alloc = BlockAllocator(6, 2)  # usable blocks 1..5
    assert committed(alloc, "a", [1, 2, 3, 4]) == [1, 2]
    assert committed(alloc, "b", [5, 6, 7, 8]) == [3, 4]
    alloc.free("a")  # LRU: 2, 1
    alloc.free("b")  # LRU: 2, 1, 4, 3
    assert list(alloc._cached_free) == [2, 1, 4, 3] and list(alloc._free) == [5]
    # never-hashed block 5 first, then the least recently used cached blocks 2 then 1
    assert alloc.allocate("c", 6) and alloc.block_table("c") == [5, 2, 1]
    alloc.check_invariants()
    assert alloc.lookup([1, 2, 3, 4, 9]).block_ids == ()  # evicted
    assert alloc.lookup([5, 6, 7, 8, 9]).block_ids == (3, 4)  # still cached
    assert alloc.usage() == {"num_blocks": 5, "used": 3, "cached_free": 2, "free": 0,
                             "usage": 0.6, "prefix_cache_queries": 14, "prefix_cache_hits": 0}


def test_reverse_order_release_of_unhashed_and_hashed_blocks():
    alloc = BlockAllocator(8, 2, enable_prefix_caching=False)
    assert alloc.allocate("a", 6) and alloc.block_table("a") == [1, 2, 3]
    alloc.free("a")
    assert list(alloc._free) == [4, 5, 6, 7, 3, 2, 1]  # FIFO; a's tail released first
    assert alloc.allocate("b", 10) and alloc.block_table("b") == [4, 5, 6, 7, 3]
    cached = BlockAllocator(5, 2)
    committed(cached, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    cached.free("a")
    assert list(cached._cached_free) == [4, 3, 2, 1]  # the tail is evicted first
    assert cached.allocate("b", 2) and cached.block_table("b") == [4]
    assert cached.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]).block_ids == (1, 2, 3)


def test_prefix_hit_after_the_original_request_finished():
    alloc = BlockAllocator(8, 2)
    assert committed(alloc, "a", [1, 2, 3, 4, 5]) == [1, 2, 3]  # block 3 half full: unhashed
    alloc.free("a")
    assert list(alloc._cached_free) == [2, 1] and list(alloc._free)[-1] == 3
    hit = alloc.lookup([1, 2, 3, 4, 5])
    assert hit == PrefixHit((1, 2), tuple(alloc.hash_blocks([1, 2, 3, 4])), 4, None, None)
    assert alloc.allocate("b", 5, hit)
    assert alloc.block_table("b") == [1, 2, 4] and alloc.num_computed_tokens("b") == 4
    assert not alloc._cached_free and alloc.ref_count(1) == alloc.ref_count(2) == 1
    assert alloc.usage()["prefix_cache_queries"] == 10
    assert alloc.usage()["prefix_cache_hits"] == 4
    alloc.commit("b", [1, 2, 3, 4, 5])
    alloc.check_invariants()


def test_hit_stops_at_first_differing_block_and_keeps_last_token():
    alloc = BlockAllocator(10, 2)
    committed(alloc, "a", [1, 2, 3, 4, 5, 6, 7])
    assert alloc.lookup([1, 2, 3, 9, 5, 6, 7]).block_ids == (1,)
    assert alloc.lookup([9, 2, 3, 4, 5, 6, 7]).block_ids == ()
    # a prompt of exactly k full blocks hits at most k - 1 of them
    assert alloc.lookup([1, 2, 3, 4, 5, 6]).block_ids == (1, 2)
    assert alloc.lookup([1, 2, 3, 4, 5, 6, 7]).block_ids == (1, 2, 3)
    assert alloc.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]).block_ids == (1, 2, 3)
    assert alloc.lookup([1]).num_tokens == 0 and alloc.lookup([]).num_tokens == 0


def test_salt_isolation_and_domain_separation():
    alloc = BlockAllocator(16, 2)
    tokens = [1, 2, 3, 4, 5]
    committed(alloc, "s", tokens, cache_salt="x")
    assert alloc.lookup(tokens).block_ids == ()
    assert alloc.lookup(tokens, cache_salt="y").block_ids == ()
    assert alloc.lookup(tokens, adapter_id="x").block_ids == ()
    assert alloc.lookup(tokens, cache_salt="x").block_ids == (1, 2)
    committed(alloc, "u", tokens)  # unsalted copy in fresh blocks
    assert alloc.block_table("u") == [4, 5, 6]
    plain = alloc.hash_blocks(tokens)
    salted = alloc.hash_blocks(tokens, cache_salt="x")
    adapted = alloc.hash_blocks(tokens, adapter_id="x")
    adapted_int = alloc.hash_blocks(tokens, adapter_id=1)
    adapted_str = alloc.hash_blocks(tokens, adapter_id="1")
    for i in range(2):  # the salt enters block 0 and every later block through the chain
        assert len({plain[i], salted[i], adapted[i], adapted_int[i], adapted_str[i]}) == 5
    assert alloc.hash_blocks(tokens) == BlockAllocator(4, 2).hash_blocks(tokens)  # stable
    hit = alloc.lookup(tokens, cache_salt="x")
    with pytest.raises(ValueError):
        alloc.allocate("v", 5, hit, cache_salt="y")
    assert alloc.allocate("v", 5, hit) and alloc.block_table("v")[:2] == [1, 2]
    alloc.commit("v", tokens)
    alloc.check_invariants()


def test_forced_hash_collision_is_a_miss_not_a_wrong_hit():
    alloc = BlockAllocator(16, 2, hash_fn=lambda data: b"\x00" * 8)
    committed(alloc, "x", [1, 2, 3, 4])
    committed(alloc, "y", [5, 6, 7, 8])
    assert alloc.lookup([5, 6, 3, 4, 9]).block_ids == (3,)  # y's block 0, then x's block differs
    assert alloc.lookup([1, 2, 7, 8, 9]).block_ids == (1,)  # block 4 holds 7,8 but after 5,6
    assert alloc.lookup([9, 9, 3, 4, 9]).block_ids == ()
    assert alloc.lookup([1, 2, 3, 4, 9]).block_ids == (1, 2)
    assert alloc.lookup([1, 2, 3, 4, 9], cache_salt="s").block_ids == ()


def test_duplicate_content_keeps_both_and_prefers_the_earliest():
    alloc = BlockAllocator(8, 2)
    assert alloc.allocate("a", 3) and alloc.allocate("b", 3)  # same prompt, no hit for either
    alloc.commit("b", [1, 2, 3])
    alloc.commit("a", [1, 2, 3])
    assert alloc.block_table("a") == [1, 2] and alloc.block_table("b") == [3, 4]
    assert alloc.lookup([1, 2, 3]).block_ids == (3,)  # b registered first
    alloc.free("b")
    alloc.free("a")
    assert alloc.allocate("c", 6) and alloc.block_table("c") == [5, 6, 7]
    alloc.check_invariants()
    assert alloc.allocate("d", 2) and alloc.block_table("d") == [4]  # 4 was unhashed
    assert alloc.allocate("e", 2) and alloc.block_table("e") == [2]  # 2 was unhashed
    assert alloc.allocate("f", 2) and alloc.block_table("f") == [3]  # evicts 3 (LRU)
    assert alloc.lookup([1, 2, 3]).block_ids == (1,)
    alloc.check_invariants()


def test_copy_on_write_of_shared_partial_last_block_after_fork():
    alloc = BlockAllocator(8, 4)
    assert committed(alloc, "a", [1, 2, 3, 4, 5, 6]) == [1, 2]
    alloc.fork("a", "b")
    assert alloc.block_table("b") == [1, 2] and alloc.num_computed_tokens("b") == 6
    assert alloc.ref_count(1) == alloc.ref_count(2) == 2
    alloc.check_invariants()
    with pytest.raises(AllocationError):
        alloc.commit("b", [1, 2, 3, 4, 5, 6, 7])  # would write into the shared block 2
    assert alloc.grow("a", 7) == [(2, 3)]
    assert alloc.block_table("a") == [1, 3] and alloc.block_table("b") == [1, 2]
    assert (alloc.ref_count(1), alloc.ref_count(2), alloc.ref_count(3)) == (2, 1, 1)
    alloc.commit("a", [1, 2, 3, 4, 5, 6, 7])
    assert alloc.grow("b", 9) == []  # b owns block 2 now; one new block appended
    assert alloc.block_table("b") == [1, 2, 4]
    alloc.commit("b", [1, 2, 3, 4, 5, 6, 8, 8, 9])
    alloc.check_invariants()
    assert alloc.lookup([1, 2, 3, 4, 5, 6, 8, 8, 9]).block_ids == (1, 2)
    alloc.free("a")
    alloc.free("b")
    alloc.check_invariants()
    assert alloc.usage()["used"] == 0


def test_copy_on_write_skips_the_copy_of_unwritten_reserved_blocks():
    alloc = BlockAllocator(10, 4, policy="oracle")
    assert alloc.allocate("a", 4, final_num_tokens=12)
    assert alloc.block_table("a") == [1, 2, 3]
    alloc.commit("a", [1, 2, 3, 4])
    alloc.fork("a", "b")
    alloc.check_invariants()
    assert alloc.grow("a", 5) == []  # block 2 replaced by 4, but it held nothing to copy
    assert alloc.block_table("a") == [1, 4, 3] and alloc.block_table("b") == [1, 2, 3]
    assert alloc.grow("a", 12) == [] and alloc.block_table("a") == [1, 4, 5]
    alloc.check_invariants()


def test_failed_allocate_and_grow_change_nothing():
    alloc = BlockAllocator(5, 2)  # 4 usable blocks
    committed(alloc, "a", [1, 2, 3, 4])
    alloc.free("a")  # cached free: 2, 1; free: 3, 4
    hit = alloc.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit.block_ids == (1, 2)
    before = snapshot(alloc)
    assert not alloc.can_allocate(9, hit)  # needs 3 fresh; only 2 free besides its own hit
    assert not alloc.allocate("b", 9, hit)
    assert snapshot(alloc) == before
    # 8 tokens: the hit blocks are taken, never evicted for this request
    hit = alloc.lookup([1, 2, 3, 4, 5, 6, 7, 8])
    assert alloc.allocate("b", 8, hit) and alloc.block_table("b") == [1, 2, 3, 4]
    before = snapshot(alloc)
    assert alloc.grow("b", 9) is None
    assert snapshot(alloc) == before
    alloc.fork("b", "c")
    alloc.commit("b", [1, 2, 3, 4])  # nothing new written
    before = snapshot(alloc)
    assert alloc.grow("b", 5) is None  # copy-on-write of block 3 impossible: pool empty
    assert snapshot(alloc) == before


def test_reset_prefix_cache_refused_while_in_use():
    alloc = BlockAllocator(6, 2)
    committed(alloc, "a", [1, 2, 3, 4, 5])
    assert not alloc.reset_prefix_cache()
    alloc.free("a")
    assert list(alloc._free) == [4, 5, 3] and list(alloc._cached_free) == [2, 1]
    assert alloc.reset_prefix_cache()
    alloc.check_invariants()
    assert list(alloc._free) == [4, 5, 3, 2, 1] and not alloc._cached_free
    assert alloc.lookup([1, 2, 3, 4, 5]).block_ids == ()
    assert alloc.usage()["free"] == 5


def test_policies_reserve_the_right_block_counts():
    paged = BlockAllocator(20, 4)
    assert paged.allocate("a", 5) and len(paged.block_table("a")) == 2
    assert paged.grow("a", 9) == [] and len(paged.block_table("a")) == 3
    full = BlockAllocator(20, 4, policy="max", max_model_len=16)
    assert full.can_allocate(5) and full.allocate("a", 5)
    assert full.block_table("a") == [1, 2, 3, 4] and full.num_free_blocks == 15
    assert full.grow("a", 16) == [] and full.num_free_blocks == 15
    with pytest.raises(ValueError):
        full.grow("a", 17)
    assert not BlockAllocator(4, 4, policy="max", max_model_len=16).can_allocate(1)
    with pytest.raises(ValueError):
        BlockAllocator(20, 4, policy="max")
    oracle = BlockAllocator(20, 4, policy="oracle")
    assert oracle.allocate("a", 5, final_num_tokens=10) and oracle.block_table("a") == [1, 2, 3]
    assert oracle.grow("a", 10) == [] and oracle.num_free_blocks == 16
    assert oracle.grow("a", 13) == [] and oracle.block_table("a") == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        oracle.allocate("b", 5)  # final_num_tokens missing
    for alloc in (paged, full, oracle):
        alloc.check_invariants()


def test_misuse_raises():
    alloc = BlockAllocator(6, 2)
    committed(alloc, "a", [1, 2, 3])
    with pytest.raises(AllocationError):
        alloc.allocate("a", 2)
    with pytest.raises(AllocationError):
        alloc.grow("zz", 2)
    with pytest.raises(AllocationError):
        alloc.fork("a", "a")
    with pytest.raises(ValueError):
        alloc.commit("a", [1, 2, 3, 4, 5])  # beyond the table's capacity
    with pytest.raises(ValueError):
        alloc.commit("a", [1, 2])  # shrinking
    with pytest.raises(ValueError):
        BlockAllocator(1, 2)
    with pytest.raises(ValueError):
        BlockAllocator(4, 2, policy="lazy")
    alloc.free("a")
    stale = alloc.lookup([1, 2, 3])
    assert stale.block_ids == (1,)
    assert alloc.allocate("b", 10)  # evicts block 1
    alloc.free("b")
    with pytest.raises(AllocationError):
        alloc.allocate("c", 3, stale)
    with pytest.raises(AllocationError):
        alloc.free("a")
    alloc.check_invariants()


def test_allocator_does_not_import_jax():
    for path in MODULE_PATHS:
        tree = ast.parse(path.read_text())
        names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names]
        names += [node.module or "" for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in ("jax", "jaxlib", "numpy")], (
            path.name, names)
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "import jaxpage.engine.block_allocator as module\n"
        "alloc = module.BlockAllocator(4, 2)\n"
        "assert len(alloc.hash_blocks([1, 2, 3], cache_salt='s', adapter_id=1)) == 1\n"
        "alloc.check_invariants()\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
        "assert 'numpy' not in sys.modules, 'numpy was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- two tiers, by hand


def test_evicted_blocks_move_to_the_host_tier_and_come_back_on_a_hit():
    alloc = TieredAllocator(4, 2, num_host_blocks=4)  # 3 usable device blocks
    assert committed(alloc, "a", [1, 2, 3, 4, 5]) == [1, 2, 3]
    alloc.free("a")  # cached: 2, 1 (LRU first); block 3 (partial) free
    assert alloc.allocate("b", 6) and alloc.block_table("b") == [3, 2, 1]
    # the two evicted cached blocks, LRU first, into host blocks 0 and 1 this step
    assert alloc.take_swaps() == ([(2, 0), (1, 1)], [])
    alloc.free("b")
    hit = alloc.lookup([1, 2, 3, 4, 5])
    assert hit.block_ids == () and hit.host_block_ids == (1, 0) and hit.num_tokens == 4
    assert alloc.allocate("c", 5, hit)
    assert alloc.block_table("c") == [1, 2, 3] and alloc.num_computed_tokens("c") == 4
    assert alloc.take_swaps() == ([], [(1, 1), (0, 2)])  # host -> the first fresh blocks
    alloc.commit("c", [1, 2, 3, 4, 5])
    alloc.check_invariants()
    usage = alloc.usage()
    assert (usage["prefix_cache_hits"], usage["prefix_cache_host_hits"]) == (4, 4)
    assert (usage["host_cached"], usage["host_free"]) == (2, 2)  # still cached on the host


def test_swap_out_shares_and_reads_pending_copy_on_write_at_its_source():
    alloc = TieredAllocator(8, 4, num_host_blocks=4)
    assert committed(alloc, "a", [1, 2, 3, 4, 5, 6]) == [1, 2]  # block 2 partly filled
    alloc.fork("a", "b")
    assert alloc.grow("a", 7) == [(2, 3)]  # a writes next: its copy of block 2 is pending
    # the scheduler preempts both before the copy is made: block 3 is read at block 2
    assert alloc.blocks_to_swap_out([("a", 6), ("b", 6)], {3: 2}) == 2
    assert alloc.swap_out([("a", 6), ("b", 6)], {3: 2})
    assert alloc.swapped_table("a") == alloc.swapped_table("b") == [0, 1]
    assert alloc.take_swaps() == ([(1, 0), (2, 1)], [])
    assert [alloc.host.ref_count(h) for h in (0, 1)] == [2, 2]
    alloc.check_invariants()
    # back together: the full block is shared again; the partly filled one, which both
    # write next, is copied once per sequence (and block 1 is still cached on the device)
    assert alloc.swap_in([("a", 7, None), ("b", 7, None)])
    assert alloc.block_table("a") == [1, 4] and alloc.block_table("b") == [1, 5]
    assert alloc.ref_count(1) == 2 and alloc.take_swaps() == ([], [(1, 4), (1, 5)])
    alloc.check_invariants()
    assert alloc.usage()["host_used"] == 0


def test_a_host_block_read_this_step_is_not_rewritten_in_the_same_step():
    alloc = TieredAllocator(6, 2, num_host_blocks=1, enable_prefix_caching=False)
    committed(alloc, "a", [1, 2])
    committed(alloc, "c", [3, 4])
    assert alloc.swap_out([("a", 2)])
    alloc.take_swaps()
    assert alloc.swap_in([("a", 3, None)])  # reads host block 0 this step
    assert not alloc.swap_out([("c", 2)])  # it would write block 0 before that read
    swap_out, swap_in = alloc.take_swaps()
    assert swap_out == [] and len(swap_in) == 1
    assert alloc.swap_out([("c", 2)]) and alloc.swapped_table("c") == [0]  # next step
    alloc.check_invariants()


def test_host_pool_lru_keeps_what_was_used_last():
    from jaxpage.engine.host_pool import HostBlockPool

    pool = HostBlockPool(2, caching=True)
    keys = [(bytes([i]), (i,), None, b"") for i in range(3)]
    assert pool.take(keys[0], 0) == 0 and pool.take(keys[1], 0) == 1
    assert pool.find_key(keys[0]) == 0
    pool.touch(0)  # block 0's content was evicted from the device again: it is recent
    assert pool.take(keys[2], 0) == 1  # the LRU, block 1, makes room
    assert pool.find_key(keys[1]) is None and pool.find_key(keys[0]) == 0
    pool.check_invariants([0, 0])
