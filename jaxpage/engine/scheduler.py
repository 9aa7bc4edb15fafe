"""Continuous batching: which requests run this step, and how many tokens each (no JAX).

Each step serves the running requests first (oldest first: one decode token each, or the
next chunk of a prompt still being prefilled), then admits waiting requests in arrival
order while the token budget, `max_num_seqs` and the pool allow; a prompt longer than the
remaining budget is prefilled in chunks over several steps, and prompt blocks found in the
prefix cache (either tier) are skipped. When the pool cannot give a running request the
blocks it needs, the newest running request (with its running siblings: a request's samples
go together) is preempted to the front of the waiting queue, keeping its generated tokens.
By recompute, its blocks are freed and its tokens prefilled again when it is readmitted; by
swapping (`preemption_mode` "swap", or "auto" when the cost model agrees, and only while the
host pool has room), its blocks are copied to the host pool and, when it is readmitted,
back into the device pool, all its swapped samples together, before it decodes on. No
request is admitted in a step that preempted one.

The scheduler owns the allocator (device and host tiers) and every change to the sequences
it serves: after the runner has executed a step, `update` applies the results (K/V
committed and hashed, tokens appended, samples forked, beam plans applied, sequences ended
on EOS, stop tokens and length), in that order, in one place.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable

from jaxpage.engine.batch import SeqInput, SeqResult
from jaxpage.engine.beam_search import BeamGroup, BeamPlan, NextBeam
from jaxpage.engine.block_hashing import encode_extra_keys
from jaxpage.engine.kv_groups import WindowedAllocator, window_blocks_per_seq
from jaxpage.engine.lora_slots import LoRASlots
from jaxpage.engine.request import Request, RequestGroup, RequestStatus
from jaxpage.engine.speculative import (
    DRAFT_SLOT,
    Acceptance,
    NgramProposer,
    SpecStats,
    SpeculativeConfig,
    StepCost,
    expected_gain,
    num_accepted,
)
from jaxpage.engine.swap_cost import SwapCostModel
from jaxpage.engine.tiered_allocator import TieredAllocator
from jaxpage.sampling_params import SamplingParams, SamplingRow, sample_seed
from jaxpage.structured import bad_word_bans


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
    window_block_table: list[int] | None = None  # the window group's (sliding layers)
    # speculative decoding: the drafts run after the request's last token (the chunk's
    # num_new_tokens counts them), one draw verifying each
    draft_tokens: list[int] | tuple[()] = ()


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. The device runs it in this order: `swap_out` (reads blocks that
    this step may hand out again, so before anything writes the pool), `swap_in`,
    `block_copies`, then the forward over `seqs`."""

    chunks: list[ScheduledChunk]
    seqs: list[SeqInput]  # what the runner is given, one per chunk
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst), before any write
    num_batched_tokens: int
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host, device)
    # the window group's copy-on-write copies (sliding layers' pool), with block_copies
    window_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # LoRA adapters to write into device slots before the step: (slot, lora_int_id)
    lora_loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class StepUpdate:
    """What one step changed, for the engine to detokenize and report."""

    # per request group, each sample that got a token: the index of its first new token
    new_tokens: dict[RequestGroup, dict[Request, int]] = dataclasses.field(default_factory=dict)
    finished_beams: list[BeamGroup] = dataclasses.field(default_factory=list)


class DraftSlots:
    """The proposer of a draft model that runs on the device: k slots (`DRAFT_SLOT`) the
    runner fills before it verifies them (ModelRunner._fill_drafts)."""

    def propose(self, token_ids, k: int) -> list[int]:
        return [DRAFT_SLOT] * k


class Scheduler:
    """Waiting and running queues over the TieredAllocator it owns. A `preemption_mode`
    other than "recompute" needs `num_host_blocks`; "auto" decides with `swap_cost`. With a
    `window` (a model with sliding-window layers) the allocator is a WindowedAllocator whose
    window group has `num_window_blocks` blocks."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        reservation_policy: str = "paged",
        eos_token_ids: Iterable[int] = (),
        track_released: bool = False,
        num_host_blocks: int = 0,
        enable_host_prefix_cache: bool = True,
        preemption_mode: str = "recompute",
        swap_cost: SwapCostModel | None = None,
        window: int | None = None,
        num_window_blocks: int = 0,
        lookahead_rows: int = 0,
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 0,
    ) -> None:
        kwargs = dict(num_host_blocks=num_host_blocks,
                      enable_host_prefix_cache=enable_host_prefix_cache,
                      enable_prefix_caching=enable_prefix_caching, policy=reservation_policy,
                      max_model_len=max_model_len, track_released=track_released)
        self.windowed = window is not None
        self.allocator = WindowedAllocator(
            num_blocks, block_size, window=window, num_window_blocks=num_window_blocks,
            **kwargs) if self.windowed else TieredAllocator(num_blocks, block_size, **kwargs)
        self.preemption_mode = preemption_mode
        self.swap_cost = swap_cost
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.eos_token_ids = frozenset(eos_token_ids)
        # the runner may start a decode step of at most this many sequences before it reads
        # the one before (ModelRunner.lookahead_rows; 0: never, as with several processes):
        # see `_ahead_marks`
        self.lookahead_rows = lookahead_rows
        # speculative decoding (jaxpage.engine.speculative): a decoding sequence's drafts
        # run with its last token, and `update` accepts those the target's draws confirm
        self.speculative = speculative
        self.proposer = None
        if speculative is not None:
            self.proposer = DraftSlots() if speculative.method == "draft_model" else (
                NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max))
        self.spec_stats = SpecStats()
        # what a step costs on this machine (the engine observes it), for an adaptive
        # speculative_config, and its terms at the last step's batch (StepCost.terms)
        self.step_cost = StepCost() if speculative is not None and speculative.adaptive else None
        self._terms = (1.0, 0.0, 0.0)
        # multi-LoRA: the adapter each device slot holds (none: no LoRA)
        self.loras = LoRASlots(max_loras) if max_loras else None
        self._no_lora_slot_at = 0  # the step that last found every LoRA slot in use
        self.num_steps = 0  # steps scheduled (resting requests try again at the same one)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.failed: list[RequestGroup] = []  # ended by a failure, not yet reported
        self.num_preemptions = 0
        self.num_swapped_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @staticmethod
    def check_cache_salt(cache_salt: str | None) -> None:
        """Raise ValueError for a cache_salt the prefix cache cannot key blocks by (the
        allocator's own check, for a request's door)."""
        encode_extra_keys(cache_salt, None)

    def blocks_needed(self, num_prompt_tokens: int, num_tokens: int, n: int = 1
                      ) -> tuple[int, int]:
        """The most KV blocks `n` samples of a request of `num_tokens` tokens (its prompt's
        and max_tokens) hold at once: (in the device pool, the first sample's blocks as the
        reservation policy reserves them, then every other sample's own: shared prompt blocks
        once, its last, partly filled one copied; in the window group's pool, each sample at
        most its window's blocks, or 0 without sliding-window layers)."""
        bs = self.allocator.block_size
        whole = -(-num_tokens // bs)
        own_blocks = whole - num_prompt_tokens // bs
        need = -(-self.allocator.reserved_tokens(num_tokens) // bs) + (n - 1) * own_blocks
        if not self.windowed:
            return need, 0
        window = self.allocator.window_group.window
        return need, n * min(whole, window_blocks_per_seq(
            window, bs, self.max_num_batched_tokens, self.max_model_len))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, ScheduledChunk] = {}  # in running order
        preempted: list[Request] = []

        def drop(requests: list[Request]) -> dict[int, int]:  # unschedule (preempted, failed)
            nonlocal budget
            pending_copies = {}  # their copy-on-write copies, not made: {dst: src}
            for request in requests:
                dropped = scheduled.pop(request, None)
                if dropped is not None:  # an older sibling already scheduled this step
                    budget += dropped.num_new_tokens
                    pending_copies.update((dst, src) for src, dst in dropped.block_copies)
            return pending_copies

        # 1. running requests, oldest first; preempt the newest when the pool runs dry
        grow = self.allocator.grow
        plans = self._plan_drafts() if self.proposer is not None else {}
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted with a sibling
                continue
            num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' log-probs
                continue
            drafts = plans[request][: budget - 1] if (
                plans and num_new == 1 and request in plans) else ()
            try:
                while (copies := grow(request.seq_id, request.num_computed_tokens + num_new
                                      + len(drafts))) is None:
                    if drafts:  # the pool is short: drop the drafts before preempting
                        drafts = ()
                        continue
                    victims = self._newest_group()
                    self._preempt(victims, drop(victims))
                    preempted += victims
                    if request.status is not RequestStatus.RUNNING:
                        break
            except Exception as exc:  # a failed grow changed nothing: fail this request only
                drop(self.fail(request.group, exc))
                continue
            if copies is None:  # the request itself was preempted: nothing newer is left
                break
            scheduled[request] = self._chunk(request, num_new, copies, drafts)
            budget -= num_new + len(drafts)

        # 2. waiting requests in arrival order (not in a step that had to preempt); a
        # parent whose n samples fork at the end of its prefill holds n running slots
        slots = sum(r.num_slots for r in self.running)
        waiting_for_slots: list[Request] = []  # requests whose adapter found no LoRA slot
        while self.waiting and not preempted and budget > 0:
            request = self.waiting[0]
            if request.status is RequestStatus.SWAPPED:  # back with its swapped samples
                if not self._lora_slot(request):
                    break
                try:
                    admitted = self._swap_in(budget, self.max_num_seqs - slots)
                except Exception as exc:  # a failed swap_in changed nothing
                    self.fail(request.group, exc)
                    continue
                if not admitted:
                    break
                for member, num_new in admitted:
                    self.waiting.popleft()
                    member.status = RequestStatus.RUNNING
                    self.running.append(member)
                    slots += member.num_slots
                    scheduled[member] = self._chunk(member, num_new, [])
                    budget -= num_new
                continue
            if slots + request.num_slots > self.max_num_seqs:
                break
            if not self._lora_slot(request):  # its adapter waits for a slot; others go on
                waiting_for_slots.append(self.waiting.popleft())
                continue
            try:
                hit = None
                adapter = request.lora.cache_key if request.lora is not None else None
                if self.enable_prefix_caching and not request.scoring_prompt:
                    hit = self.allocator.lookup(request.token_ids,
                                                cache_salt=request.cache_salt, adapter_id=adapter)
                num_cached = hit.num_tokens if hit is not None else 0
                num_new = min(request.num_tokens - num_cached, budget)
                admitted = self.allocator.allocate(
                    request.seq_id, num_cached + num_new, hit,
                    final_num_tokens=request.max_num_tokens, cache_salt=request.cache_salt,
                    adapter_id=adapter)
            except Exception as exc:  # a failed allocate changed nothing: fail this request
                self.fail(request.group, exc)
                continue
            if not admitted:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.perf_counter()
                request.metrics.num_cached_tokens = num_cached
            self.running.append(request)
            slots += request.num_slots
            scheduled[request] = self._chunk(request, num_new, [])
            budget -= num_new
        self.waiting.extendleft(reversed(waiting_for_slots))  # in their order, first

        # 3. a sequence that may run ahead (`_ahead_marks`) and whose next token starts a block
        # takes that block now, a step early, from what this step left free: the step after it
        # can then run ahead too (its next slot must be in a block the sequence holds)
        lookahead = 0 < len(self.running) <= self.lookahead_rows
        marks = {request: self._ahead_marks(request, chunk.num_new_tokens) if lookahead
                 else (False, False) for request, chunk in scheduled.items()}
        for request, chunk in scheduled.items() if lookahead else ():
            end = chunk.num_computed_tokens + chunk.num_new_tokens  # the next token's position
            if marks[request][0] and end % self.allocator.block_size == 0:
                extra = self.allocator.grow(request.seq_id, end + 1)
                if extra is not None:  # None: the pool is short, nothing taken
                    chunk.block_copies = chunk.block_copies + extra
                    chunk.block_table, chunk.window_block_table = self._tables(request)

        chunks = list(scheduled.values())
        copies = [copy for chunk in chunks for copy in chunk.block_copies]
        swap_out, swap_in = self.allocator.take_swaps()
        # a preempted chunk's window copies go too: they only write blocks it freed
        window_copies = self.allocator.take_window_copies() if self.windowed else []
        return SchedulerOutput(chunks, [self._seq_input(chunk, *marks[chunk.request])
                                        for chunk in chunks], copies,
                               self.max_num_batched_tokens - budget, swap_out, swap_in,
                               window_copies,
                               self.loras.take_loads() if self.loras is not None else [])

    def _lora_slot(self, request: Request) -> bool:
        """Whether `request` may run as far as its LoRA adapter goes: it has none, or the
        adapter holds a device slot (found now if need be: `LoRASlots.acquire`). Once a step
        found no slot to give, it looks no more: no slot frees while it admits requests."""
        if request.lora is None:
            return True
        lora_id = request.lora.lora_int_id
        if self._no_lora_slot_at == self.num_steps and not self.loras.holds(lora_id):
            return False
        def in_use() -> set[int]:
            return {r.lora.lora_int_id for r in self.running if r.lora is not None}

        if self.loras.acquire(lora_id, in_use) is not None:
            return True
        self._no_lora_slot_at = self.num_steps
        return False

    def pool_lost(self, unwritten_host_blocks: list[int]) -> None:
        """The device lost the KV pool: every running request goes back to recompute, and so
        does every swapped-out one whose host copy was never written (its swap-out was
        still to run); the device prefix cache is forgotten, the rest of the host tier kept,
        and which adapter each LoRA slot held too."""
        while self.running:
            self._preempt(self._newest_group(), swap=False)
        if self.loras is not None:  # the LoRA slots may be lost too: each is written again
            self.loras.reset()
        dropped = set(self.allocator.pool_lost(unwritten_host_blocks))
        for request in self.waiting:
            if request.seq_id in dropped:
                request.status = RequestStatus.WAITING
                request.num_computed_tokens = 0

    def _newest_group(self) -> list[Request]:
        """The newest running request with its running siblings (the samples of one request
        are preempted together)."""
        victim = self.running[-1]
        group = victim.group
        return [r for r in self.running if r is victim or (group is not None
                                                             and r.group is group)]

    def _preempt(self, victims: list[Request], pending_copies: dict[int, int] | None = None,
                 *, swap: bool = True) -> None:
        """Preempt a group's running samples to the front of the waiting queue, in order:
        swapped out when the mode allows it, the cost model agrees ("auto") and the host
        pool has room, else freed to recompute. A sample keeps the K/V of at most all its
        tokens but the last, so that it draws again when it resumes (a beam whose draw
        was waiting for its siblings' drops that draw, as under recompute)."""
        kept = [(r.seq_id, min(r.num_computed_tokens, r.num_tokens - 1)) for r in victims]
        swapped = swap and self._swap_out(kept, pending_copies or {})
        for request, (_, keep) in zip(reversed(victims), reversed(kept), strict=True):
            self.running.remove(request)
            if swapped:
                request.status = RequestStatus.SWAPPED
                request.num_computed_tokens = keep
                self.num_swapped_preemptions += 1
            else:
                self.allocator.free(request.seq_id)
                request.status = RequestStatus.WAITING
                request.num_computed_tokens = 0
            request.metrics.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(request)
            if isinstance(request.group, BeamGroup):  # its draw is redone on readmission
                request.group.pending.pop(request, None)

    def _swap_out(self, kept: list[tuple[str, int]], pending_copies: dict[int, int]) -> bool:
        if self.preemption_mode == "recompute":
            return False
        if self.preemption_mode == "auto" and not self.swap_cost.prefer_swap(
                self.allocator.blocks_to_swap_out(kept, pending_copies),
                sum(keep for _, keep in kept), self.allocator.window_blocks_to_swap_out(kept)):
            return False
        return self.allocator.swap_out(kept, pending_copies)

    def _swap_in(self, budget: int, free_slots: int) -> list[tuple[Request, int]]:
        """Swap in the swapped-out samples of one request at the front of the waiting
        queue, together (sharing their blocks again), or as many of the first of them as
        the token budget, the running slots and the pool allow. Returns each admitted
        sample with the tokens it computes this step; none when even the first waits."""
        first = self.waiting[0]
        plan = []
        for request in self.waiting:
            if request.status is not RequestStatus.SWAPPED or not (
                    request is first or (first.group is not None
                                         and request.group is first.group)):
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0 or request.num_slots > free_slots:
                break
            plan.append((request, num_new))
            budget -= num_new
            free_slots -= request.num_slots
        while plan and not self.allocator.swap_in(
                [(r.seq_id, r.num_computed_tokens + num_new, r.max_num_tokens)
                 for r, num_new in plan]):
            plan.pop()
        return plan

    def _chunk(self, request: Request, num_new: int, copies: list[tuple[int, int]],
               drafts: list[int] | tuple[()] = ()) -> ScheduledChunk:
        """`num_new` of the request's tokens from its computed ones on, then `drafts`. A
        decode of one token (no drafts) updates the chunk of the request's last such decode
        (`Request.decode_records`), if it has one: a step's records live until the next."""
        start = request.num_computed_tokens
        table, window = self._tables(request)
        records = request.decode_records
        if (records is not None and num_new == 1 and not drafts
                and start + 1 == len(request.token_ids)):
            chunk = records[0]
            chunk.num_computed_tokens, chunk.block_table = start, table
            chunk.block_copies, chunk.window_block_table = copies, window
            return chunk
        return ScheduledChunk(request, start, num_new + len(drafts), table,
                              start + num_new == len(request.token_ids), copies, window, drafts)

    def _tables(self, request: Request) -> tuple[list[int], list[int] | None]:
        """The request's block table and its window group's (None without one), as the
        allocator holds them now."""
        window = self.allocator.window_table(request.seq_id) if self.windowed else None
        return self.allocator.block_table(request.seq_id), window

    def _plan_drafts(self) -> dict[Request, list[int]]:
        """Speculative drafts for the running requests about to decode (not beams, not a
        prompt whose samples fork at this draw): up to k each, no more than max_tokens and
        max_model_len leave after the token the step draws anyway; with `adaptive`, only
        those worth their cost (`Acceptance.length`), and none at all when their expected
        saving does not pay for a step with drafts (`StepCost`). A proposer that fails ends
        its request alone."""
        spec = self.speculative
        cost = self.step_cost
        if cost is not None:
            self._terms = saving, draft_cost, switch = cost.terms(len(self.running))
            threshold = cost.threshold(len(self.running))
            prior = self.spec_stats.acceptance_rate(default=0.5)
        plans, gain = {}, 0.0
        slots = isinstance(self.proposer, DraftSlots)
        for request in list(self.running):
            num_tokens = request.num_tokens
            if (request.status is not RequestStatus.RUNNING
                    or request.num_computed_tokens + 1 != num_tokens
                    or request.num_draws != 1 or isinstance(request.group, BeamGroup)
                    or (slots and request.params.uses_history)):  # rows need the drafts
                continue
            k = min(spec.num_speculative_tokens, request.max_num_tokens - num_tokens - 1,
                    self.max_model_len - num_tokens - 1)
            if cost is not None and k > 0:
                if request.acceptance is None:
                    request.acceptance = Acceptance()
                k = request.acceptance.length(k, threshold, prior, self.num_steps)
            if k <= 0:
                continue
            try:
                drafts = self.proposer.propose(request.token_ids, k)
                if request.matcher is not None and drafts:  # what its grammar allows
                    drafts = drafts[: request.matcher.validate_tokens(drafts)]
            except Exception as exc:  # changed nothing: fail this request only
                self.fail(request.group, exc)
                continue
            if drafts:
                plans[request] = drafts
                if cost is not None:
                    gain += expected_gain(request.acceptance.rate(prior), len(drafts),
                                          saving, draft_cost)
            elif cost is not None:  # tried, found nothing: a step that yields nothing
                request.acceptance.observe(0, 0, saving, switch, self.num_steps)
        if cost is not None and gain < switch:  # not worth a step with drafts: none
            for request in plans:
                request.acceptance.observe(0, 0, saving, switch, self.num_steps)
            return {}
        return plans

    def _drafts_next(self, request: Request) -> bool:
        """Whether the request's next decode may carry drafts (so no step runs ahead of
        it): always with speculation on, but for a request whose acceptance makes its next
        step propose nothing (`Acceptance.waits`)."""
        if self.speculative is None:
            return False
        return request.acceptance is None or not request.acceptance.waits(self.num_steps + 1)

    def _seq_input(self, chunk: ScheduledChunk, goes_on: bool, ends: bool) -> SeqInput:
        """The runner's view of a chunk: block table, tokens and, when it ends the known
        tokens, a sampling row per token to draw (n when the prompt's samples fork);
        `goes_on`: whether the next step may run ahead of it, `ends`: whether its draw is
        its last (`_ahead_marks`)."""
        request = chunk.request
        start = chunk.num_computed_tokens
        tokens = request.token_ids
        drafts = chunk.draft_tokens
        num_new = chunk.num_new_tokens
        # a plain decode (one draw from a row with no token lists, bans or matcher) keeps its
        # records on its request: the next one updates them in place (the persistent part of
        # the step's batch)
        num_out = len(tokens) - len(request.prompt_token_ids)
        plain = (num_new == 1 and chunk.sample and not drafts and request.num_draws == 1
                 and not request.scoring_prompt and _plain_row(request.params, num_out))
        records = request.decode_records
        if plain and records is not None and records[0] is chunk:
            seq = records[1]
            seq.block_table, seq.num_computed = chunk.block_table, start
            seq.token_ids = [tokens[start]]
            seq.window_block_table = chunk.window_block_table
            seq.may_run_ahead, seq.ends = goes_on, ends
            seq.lora_slot = self._slot_of(request)
            seq.sampling[0].step = num_out
            return seq
        rows = []
        if drafts:  # a draw at the last token and at each draft, as if each were drawn
            rows = [self._row(request, 0, j, drafts[:j]) for j in range(len(drafts) + 1)]
            return SeqInput(chunk.block_table, start, [tokens[start], *drafts], rows,
                            chunk.window_block_table, verify=True,
                            lora_slot=self._slot_of(request))
        scores: list[SamplingRow] = []
        score_from = 0
        if request.scoring_prompt:  # the prompt tokens after this chunk's, not yet scored
            score_from = len(request.prompt_logprobs) - 1 - start
            end = min(start + num_new, request.num_prompt_tokens - 1)
            k = request.params.prompt_logprobs
            scores = [SamplingRow(_score_params(k), 0, 0, forced_token=tokens[p + 1])
                      for p in range(start + score_from, end)]
        if chunk.sample:
            rows = [self._row(request, i) for i in range(request.num_draws)]
        seq = SeqInput(chunk.block_table, start,
                       [tokens[start]] if num_new == 1 else tokens[start : start + num_new],
                       scores + rows, chunk.window_block_table, goes_on, ends,
                       lora_slot=self._slot_of(request), num_scores=len(scores),
                       score_from=score_from)
        if plain:
            request.decode_records = (chunk, seq)
        return seq

    def _slot_of(self, request: Request) -> int:
        """The LoRA slot `request` runs with (0: none)."""
        return 0 if request.lora is None else self.loras.slot_of(request.lora.lora_int_id)

    def _row(self, request: Request, sample: int, ahead: int = 0,
             drafted: list[int] | None = None) -> SamplingRow:
        """The sampling row of the request's draw for its sample `sample` (a prompt whose
        samples fork), `ahead` tokens past its next one, after the tokens `drafted` (a
        speculative step's draws at its drafts)."""
        p = request.params
        num_out = request.num_output_tokens + ahead
        if _plain_row(p, num_out):  # most rows: no tokens, bans or matcher
            return SamplingRow(p, sample_seed(request.seed, sample), num_out)
        history = p.uses_history
        output = request.output_token_ids + drafted if history and drafted else (
            request.output_token_ids if history else None)
        banned: tuple[int, ...] = ()
        if num_out < p.min_tokens or request.bad_words:
            bans = set() if num_out >= p.min_tokens else set(p.stop_token_ids) | (
                set() if p.ignore_eos else self.eos_token_ids)
            if request.bad_words:
                bans |= bad_word_bans(request.bad_words, output)
            banned = tuple(sorted(bans))
        penalties = p.uses_penalties
        return SamplingRow(p, sample_seed(request.seed, sample), num_out,
                           request.prompt_token_ids if penalties else None,
                           output if penalties else None, banned, request.matcher,
                           tuple(drafted) if drafted and request.matcher is not None else ())

    def _ahead_marks(self, request: Request, num_new: int) -> tuple[bool, bool]:
        """(goes on, ends) of computing `num_new` tokens of `request`, while few enough run
        for the runner to run decode steps ahead (`lookahead_rows`). Goes on
        (SeqInput.may_run_ahead): a decode, or a prompt's last chunk while no request waits,
        that, unless its draw ends it, goes on as it is to the next position, so that the
        runner may start that decode step before it reads this one's draw: one draw, no
        prompt scores, no bad words or constraint (`SamplingParams.history_on_host`: they
        need the token the step before drew on the host; penalties count it on the device),
        no beam, and not its last by length. Ends (SeqInput.ends): such a decode (bad words
        or not) whose draw is its last by length, so that no step follows it."""
        if not (request.num_computed_tokens + num_new == request.num_tokens
                and request.num_draws == 1 and not isinstance(request.group, BeamGroup)):
            return False, False
        if num_new > 1 and (self.waiting or request.scoring_prompt):
            # a prompt's last chunk, while requests wait to be admitted into the next step (a
            # step run ahead of it would be run anew), or with prompt scores among its draws
            return False, False
        if request.num_tokens + 1 >= min(request.max_num_tokens, self.max_model_len):
            return False, True
        return not (request.params.history_on_host or self._drafts_next(request)), False

    def update(self, output: SchedulerOutput, results: list[list[SeqResult]],
               on_token: Callable[[Request], None] | None = None) -> StepUpdate:
        """Apply an executed step: record its K/V as written (hashing newly full blocks for
        the prefix cache), append each drawn token, fork a prompt's other samples at the end
        of its prefill, apply the plans of beam groups whose beams have all drawn, and
        finish sequences that drew EOS or a stop token or reached a length limit. Stop
        strings are the engine's (it detokenizes): it ends those sequences with `finish`,
        and `on_token(request)` after each token of a speculative step's accepted run but
        the last (which the engine sees with the step's other tokens) may end it there."""
        commit, finished = self.allocator.commit, RequestStatus.FINISHED
        if isinstance(self.proposer, DraftSlots):  # the drafts the runner's draft model made
            for chunk, seq in zip(output.chunks, output.seqs, strict=True):
                if chunk.draft_tokens and chunk.draft_tokens[0] == DRAFT_SLOT:
                    chunk.draft_tokens = seq.token_ids[1:]
        for chunk in output.chunks:  # before the new tokens are appended: no K/V for them
            request = chunk.request
            if request.status is finished or chunk.draft_tokens:  # drafts: in _accept
                continue
            try:
                computed = chunk.num_computed_tokens + chunk.num_new_tokens
                tokens = request.token_ids
                commit(request.seq_id, tokens if computed == len(tokens) else tokens[:computed])
                request.num_computed_tokens = computed
            except Exception as exc:
                self.fail(request.group, exc)
        now = time.perf_counter()
        update = StepUpdate()
        beam_groups: dict[BeamGroup, None] = {}
        new_tokens, append = update.new_tokens, self._append_token
        for chunk, seq, draws in zip(output.chunks, output.seqs, results, strict=True):
            request = chunk.request
            group = request.group
            if seq.num_scores and request.status is not finished:
                draws = self._score_prompt(request, draws, seq.num_scores)
            if not draws or request.status is finished:  # nothing drawn, or failed above
                continue
            if isinstance(group, BeamGroup):
                group.pending[request] = draws[0]
                beam_groups[group] = None
                continue
            try:
                if chunk.draft_tokens:
                    self._accept(chunk, draws, now, new_tokens, on_token)
                    continue
                if len(draws) == 1:  # the usual: one sample, one token
                    new_tokens[group] = starts = new_tokens.get(group) or {}
                    starts[request] = request.num_output_tokens
                    append(request, draws[0], now)
                    continue
                starts = new_tokens.setdefault(group, {})
                # end of the prompt's prefill: fork the other samples
                samples = [request, *self._fork_samples(request, len(draws) - 1)]
                for sample, draw in zip(samples, draws, strict=True):
                    starts[sample] = sample.num_output_tokens
                    append(sample, draw, now)
            except Exception as exc:
                self.fail(group, exc)
        for group in beam_groups:
            if group.ready() and not group.finished:
                try:
                    self._apply_beam_plan(group, group.plan(), now)
                except Exception as exc:
                    self.fail(group, exc)
                    continue
                if group.finished:
                    update.finished_beams.append(group)
        return update

    @staticmethod
    def _score_prompt(request: Request, draws: list[SeqResult], num_scores: int
                      ) -> list[SeqResult]:
        """Record a chunk's prompt scores (its first `num_scores` draws, each forced to the
        prompt's next token); returns the draws after them."""
        k = request.params.prompt_logprobs
        for score in draws[:num_scores]:
            entry = dict(list((score.top_logprobs or {}).items())[:k])
            entry[score.token] = score.logprob
            request.prompt_logprobs.append(entry)
        return draws[num_scores:]

    def _accept(self, chunk: ScheduledChunk, draws: list[SeqResult], now: float,
                new_tokens: dict[RequestGroup, dict[Request, int]],
                on_token: Callable[[Request], None] | None) -> None:
        """A speculative step's outcome for one sequence: its drafts are accepted while each
        equals the target's draw at its position; the K/V of the last token and of the
        accepted drafts is committed, the blocks taken for rejected ones go back, and the
        draws up to the first that differs from its draft (or the one after the last draft)
        are appended one at a time, each ending the sequence where it would have ended
        without speculation."""
        request, drafts = chunk.request, chunk.draft_tokens
        accepted = num_accepted(drafts, [draw.token for draw in draws])
        computed = chunk.num_computed_tokens + 1 + accepted
        self.allocator.commit(request.seq_id, request.token_ids + drafts[:accepted])
        request.num_computed_tokens = computed
        self.allocator.trim(request.seq_id, computed)
        self.spec_stats.record(len(drafts), accepted)
        if request.acceptance is not None:
            saving, _, switch = self._terms
            request.acceptance.observe(len(drafts), accepted, saving, switch, self.num_steps)
        new_tokens.setdefault(request.group, {})[request] = request.num_output_tokens
        finished = RequestStatus.FINISHED
        for j, draw in enumerate(draws[: accepted + 1]):
            self._append_token(request, draw, now)
            if request.status is finished:
                return
            if on_token is not None and j < accepted:
                on_token(request)
                if request.status is finished:
                    return

    def _append_token(self, request: Request, draw: SeqResult, now: float) -> None:
        p = request.params
        token = draw.token
        tokens = request.token_ids
        tokens.append(token)
        request.cumulative_logprob += draw.logprob
        if request.logprobs is not None:
            entry = dict(list((draw.top_logprobs or {}).items())[: p.logprobs])
            entry[token] = draw.logprob
            request.logprobs.append(entry)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        matcher = request.matcher
        if matcher is not None and token not in self.eos_token_ids:
            if not matcher.consume_token(token):
                raise ValueError(f"structured output: token {token} breaks the constraint "
                                 f"({matcher.get_error()})")
            if matcher.is_stopped():  # complete: nothing but EOS may follow
                return self.finish(request, "stop")
        num_out = request.num_output_tokens
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self.finish(request, "stop")
            if token in p.stop_token_ids:
                return self.finish(request, "stop", token)
        if num_out >= p.max_tokens or len(tokens) >= self.max_model_len:
            self.finish(request, "length")

    def _fork_samples(self, parent: Request, count: int) -> list[Request]:
        """Samples 1..count of `parent`'s request: each shares every block of the prompt
        (copy-on-write of the partly filled last one happens on its first write)."""
        children = []
        for index in range(1, count + 1):
            child = Request(parent.request_id, parent.prompt_token_ids, parent.params,
                            sample_seed(parent.seed, index), parent.metrics,
                            prompt=parent.prompt, cache_salt=parent.cache_salt, lora=parent.lora,
                            sample_index=index, group=parent.group,
                            matcher=None if parent.matcher is None else parent.matcher.deep_copy(),
                            bad_words=parent.bad_words, prompt_logprobs=parent.prompt_logprobs)
            self.add_fork(parent, child)
            parent.group.samples.append(child)
            children.append(child)
        parent.group.forked = True
        return children

    def _apply_beam_plan(self, group: BeamGroup, plan: BeamPlan, now: float) -> None:
        """Reshape a beam group as planned: children beyond a parent's first fork from it
        (before any beam takes its new token), beams without children end. The group's
        first planned step is its first token (every beam shares the root's metrics)."""
        group.pending.clear()
        metrics = group.samples[0].metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        group.finished_hyps, group.improvable = plan.finished_hyps, plan.improvable
        beams = group.samples
        if plan.done:
            for beam in beams:
                self.finish(beam, "stop")
            group.done = True
            return
        kept = {next_beam.parent for next_beam in plan.next_beams}
        for b, beam in enumerate(beams):
            if b not in kept:
                self.finish(beam, "stop")
        children: dict[NextBeam, Request] = {}
        for next_beam in sorted((nb for nb in plan.next_beams if nb.fork),
                                key=lambda nb: nb.parent):  # stable: HF's order per parent
            parent = beams[next_beam.parent]
            group.next_index += 1
            child = Request(parent.request_id, parent.prompt_token_ids, parent.params,
                            parent.seed, parent.metrics, prompt=parent.prompt,
                            cache_salt=parent.cache_salt, lora=parent.lora,
                            sample_index=group.next_index,
                            group=group, token_ids=list(parent.token_ids))
            child.cumulative_logprob = parent.cumulative_logprob
            self.add_fork(parent, child)
            children[next_beam] = child
        group.samples, group.scores = [], {}
        for next_beam in plan.next_beams:
            beam = children.get(next_beam) or beams[next_beam.parent]
            beam.token_ids.append(next_beam.token)
            beam.cumulative_logprob += next_beam.logprob
            group.scores[id(beam)] = next_beam.score
            group.samples.append(beam)
        group.forked = True

    def add_fork(self, parent: Request, child: Request) -> None:
        """Run `child`, which shares all of `parent`'s blocks, right after its parent."""
        self.allocator.fork(parent.seq_id, child.seq_id)
        child.status = RequestStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        index = self.running.index(parent) + 1
        while index < len(self.running) and self.running[index].group is parent.group:
            index += 1
        self.running.insert(index, child)

    def fail(self, group: RequestGroup, exc: BaseException) -> list[Request]:
        """End every sample of a request that a failure in a step hit, with finish reason
        "abort" and the error recorded on the group (the engine reports it); returns the
        samples ended. Other requests are untouched."""
        group.error = f"{type(exc).__name__}: {exc}"
        ended = [s for s in group.samples if not s.finished]
        for sample in ended:
            self.finish(sample, "abort")
        if isinstance(group, BeamGroup):
            group.done = True
        self.failed.append(group)
        return ended

    def take_failed(self) -> list[RequestGroup]:
        """The requests failed since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def finish(self, request: Request, reason: str, stop_reason=None) -> None:
        """End a request (stop, length or abort) wherever it is and free its blocks; on a
        request already finished this step, only its reason changes (a stop string found
        on the token that also reached max_tokens)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.allocator.free(request.seq_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.waiting.remove(request)
            self.allocator.drop_swapped(request.seq_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason


def _plain_row(params: SamplingParams, num_out: int) -> bool:
    """Whether the draw of output token `num_out` is a plain row: no token history (penalties,
    bad words, a grammar) and no bans (min_tokens reached)."""
    return not params.uses_history and num_out >= params.min_tokens


@functools.cache
def _score_params(k: int) -> SamplingParams:
    """A prompt-scoring row's parameters: greedy (its token is forced anyway), the top `k`
    log-probabilities reported."""
    return SamplingParams(temperature=0.0, logprobs=k)
