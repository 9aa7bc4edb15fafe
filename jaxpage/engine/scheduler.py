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
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Request] = []

        # 1. running requests, oldest first; preempt the newest when the pool runs dry
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while True:
                block_copies = self.allocator.grow(
                    request.request_id, request.num_computed_tokens + num_new
                )
                if block_copies is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if block_copies is None:  # the request preempted itself
                break
            copies.extend(block_copies)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1

        # 2. waiting requests in arrival order (not in a step that had to preempt)
        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            hit = None
            if self.enable_prefix_caching:
                hit = self.allocator.lookup(request.token_ids, cache_salt=request.cache_salt)
            num_cached = hit.num_tokens if hit is not None else 0
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.allocator.allocate(
                request.request_id, num_cached + num_new, hit,
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
            chunks.append(self._chunk(request, num_new))
            budget -= num_new

        return SchedulerOutput(chunks, copies, preempted, self.max_num_batched_tokens - budget)

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request=request,
            num_computed_tokens=start,
            num_new_tokens=num_new,
            block_table=self.allocator.block_table(request.request_id),
            sample=start + num_new == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.allocator.free(request.request_id)
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
            self.allocator.commit(request.request_id,
                                  tokens if computed == len(tokens) else tokens[:computed])

    def finish(self, request: Request, reason: str, stop_reason=None) -> None:
        """End a request (stop, length or abort) wherever it is and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.allocator.free(request.request_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
