"""Continuous batching: which requests run this step, and how many tokens each (no JAX).

Each step serves the running requests first (oldest first: one decode token each, or the
next chunk of a prompt still being prefilled), then admits waiting requests in arrival
order while the token budget, `max_num_seqs` and the pool allow; a prompt longer than the
remaining budget is prefilled in chunks over several steps, and prompt blocks found in the
prefix cache are skipped. When the pool cannot give a running request the blocks it needs,
the newest running request is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue, keeping its generated tokens, which are prefilled again
when it is readmitted. No request is admitted in a step that preempted one.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from jaxpage.engine.block_allocator import BlockAllocator
from jaxpage.engine.request import Request, RequestStatus


@dataclasses.dataclass(slots=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `request` starting at `num_computed_tokens`.

    `sample` is true when the chunk ends at the request's last token, so a new token is
    drawn from its logits (false for a prompt chunk that is not the last one).
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    sample: bool
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst), before any write
    preempted: list[Request]
    num_batched_tokens: int


class Scheduler:
    """Waiting and running queues over one BlockAllocator."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, ScheduledChunk] = {}  # in running order
        preempted: list[Request] = []

        # 1. running requests, oldest first; preempt the newest when the pool runs dry
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted with a sibling
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' log-probs
                continue
            while (copies := self.allocator.grow(
                    request.seq_id, request.num_computed_tokens + num_new)) is None:
                for victim in self._preempt_newest():
                    preempted.append(victim)
                    dropped = scheduled.pop(victim, None)
                    if dropped is not None:  # an older sibling already scheduled this step
                        budget += dropped.num_new_tokens
                if request.status is not RequestStatus.RUNNING:
                    break
            if copies is None:  # the request itself was preempted: nothing newer is left
                break
            scheduled[request] = self._chunk(request, num_new, copies)
            budget -= num_new

        # 2. waiting requests in arrival order (not in a step that had to preempt)
        while self.waiting and not preempted and budget > 0:
            request = self.waiting[0]
            if len(self.running) + request.num_slots > self.max_num_seqs:
                break
            hit = None
            if self.enable_prefix_caching:
                hit = self.allocator.lookup(request.token_ids, cache_salt=request.cache_salt)
            num_cached = hit.num_tokens if hit is not None else 0
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.allocator.allocate(
                request.seq_id, num_cached + num_new, hit,
                final_num_tokens=request.max_num_tokens, cache_salt=request.cache_salt,
            ):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.perf_counter()
                request.metrics.num_cached_tokens = num_cached
            self.running.append(request)
            scheduled[request] = self._chunk(request, num_new, [])
            budget -= num_new

        chunks = list(scheduled.values())
        copies = [copy for chunk in chunks for copy in chunk.block_copies]
        return SchedulerOutput(chunks, copies, preempted, self.max_num_batched_tokens - budget)

    def _preempt_newest(self) -> list[Request]:
        """Preempt the newest running request, together with its running siblings (the
        samples of one request are recomputed as a group)."""
        victim = self.running[-1]
        group = victim.group
        victims = [r for r in self.running if r is victim or (group is not None
                                                                and r.group is group)]
        for request in reversed(victims):
            self.running.remove(request)
            self._preempt(request)
        return victims

    def _chunk(self, request: Request, num_new: int,
               copies: list[tuple[int, int]]) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request=request,
            num_computed_tokens=start,
            num_new_tokens=num_new,
            block_table=self.allocator.block_table(request.seq_id),
            sample=start + num_new == request.num_tokens,
            block_copies=copies,
        )

    def _preempt(self, request: Request) -> None:
        self.allocator.free(request.seq_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def commit(self, output: SchedulerOutput) -> None:
        """Record that the step's K/V is written: advance computed counts and let the
        allocator hash newly full blocks for the prefix cache."""
        for chunk in output.chunks:
            request = chunk.request
            if request.finished:
                continue
            computed = chunk.num_computed_tokens + chunk.num_new_tokens
            request.num_computed_tokens = computed
            tokens = request.token_ids  # called before the step's new tokens are appended
            self.allocator.commit(request.seq_id,
                                  tokens if computed == len(tokens) else tokens[:computed])

    def add_fork(self, parent: Request, child: Request) -> None:
        """Run `child`, which shares all of `parent`'s blocks, right after its parent."""
        self.allocator.fork(parent.seq_id, child.seq_id)
        child.status = RequestStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        index = self.running.index(parent) + 1
        while index < len(self.running) and self.running[index].group is parent.group:
            index += 1
        self.running.insert(index, child)

    def finish(self, request: Request, reason: str, stop_reason=None) -> None:
        """End a request (stop, length or abort) wherever it is and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.allocator.free(request.seq_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
