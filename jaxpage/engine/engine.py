"""LLMEngine: requests in, one scheduled and executed step at a time, outputs out.

The engine validates requests where they enter, asks the scheduler what to run, hands the
runner the scheduler's plain lists, gives the results back to the scheduler (which appends
the tokens, forks, advances beams and ends sequences on EOS, stop tokens and lengths), then
detokenizes, ends sequences on stop strings and builds the outputs. It imports no JAX and
does no device math: the runner (`jaxpage.engine.runner`, or any object with the interface
of `jaxpage.engine.runner_api.Runner`) owns the device.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpage.engine import gc_tuning
from jaxpage.engine.beam_search import BeamGroup
from jaxpage.engine.detokenizer import IncrementalDetokenizer, TextDecoder
from jaxpage.engine.lora_slots import LoRARegistry
from jaxpage.engine.output_builder import beam_output, sample_deltas
from jaxpage.engine.request import Request, RequestGroup, RequestStatus
from jaxpage.engine.runner_api import (
    ENGINE_PHASES,
    RUNNER_PHASES,
    CopyBlocks,
    DeviceWork,
    FillBlocks,
    LoadLoRA,
    Runner,
    StepTimer,
    SwapIn,
    SwapOut,
)
from jaxpage.engine.scheduler import Scheduler, SchedulerOutput
from jaxpage.engine.swap_cost import SwapCostModel
from jaxpage.outputs import RequestMetrics, RequestOutput
from jaxpage.sampling_params import (
    MAX_LOGPROBS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)
from jaxpage.validation import is_int, is_vector

if TYPE_CHECKING:
    from jaxpage.config import EngineConfig
    from jaxpage.engine.tiered_allocator import TieredAllocator
    from jaxpage.lora import LoRARequest

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_FINISHED = RequestStatus.FINISHED


FINISHED_METRICS_KEPT = 65536  # requests whose latencies stats() summarizes


class LLMEngine:
    """Continuous-batching engine over one model.

    `model` is any object with a `config` (num_layers, num_kv_heads, head_dim, vocab_size,
    max_position_embeddings) and `forward(params, token_ids, positions, kv_pool, metadata)`.
    `draft`: a speculative decoding draft's (model, params); by default the one
    `speculative_config.model` names is loaded (and checked against the target's vocabulary).
    """

    def __init__(self, config: EngineConfig, model: Any, params: Any, tokenizer: Any = None,
                 *, runner: Runner | None = None, devices: list | None = None,
                 draft: tuple[Any, Any] | None = None):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        model_config = model.config
        limit = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len must be <= the model's limit {limit}, "
                             f"got {config.max_model_len}")
        self.max_model_len = config.max_model_len or limit
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = set(getattr(model_config, "eos_token_ids", ()) or ())
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        if runner is None:  # the device side, imported here so this module imports no JAX
            from jaxpage.engine.runner import build_runner

            spec = config.speculative_config
            if draft is None and spec is not None and spec.draft_checkpoint:
                from jaxpage.loading import load_draft

                draft = load_draft(spec.draft_checkpoint, model_config, tokenizer,
                                   config.dtype, config.cache_gguf)
            runner = build_runner(model, params, config, max_model_len=self.max_model_len,
                                  devices=devices, draft=draft)
        self.runner = runner
        self.swap_cost = None
        if config.preemption_mode == "auto":
            self.swap_cost = SwapCostModel(runner.block_bytes, runner.window_block_bytes,
                                           config.swap_bandwidth,
                                           config.prefill_seconds_per_token)
        self.scheduler = Scheduler(
            num_blocks=runner.num_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            reservation_policy=config.reservation_policy, eos_token_ids=self.eos_token_ids,
            track_released=config.debug_nan_pool, num_host_blocks=runner.num_host_blocks,
            enable_host_prefix_cache=config.enable_host_prefix_cache,
            preemption_mode=config.preemption_mode, swap_cost=self.swap_cost,
            window=runner.window, num_window_blocks=runner.num_window_blocks,
            lookahead_rows=runner.lookahead_rows, speculative=config.speculative_config,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        # multi-LoRA: the adapters known and read (the runner holds those in device slots)
        self.loras = None
        if config.enable_lora:
            from jaxpage.lora import read_peft_adapter

            self.loras = LoRARegistry(
                config.max_cpu_loras or config.max_loras,
                lambda request: read_peft_adapter(request, model_config, config.max_lora_rank))
        self.grammars = None  # structured outputs' compiled constraints, made on first use
        self.requests: dict[str, RequestGroup] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._text_decoder = TextDecoder(tokenizer) if tokenizer is not None else None
        self._pending: list[RequestOutput] = []  # outputs of aborts between steps
        # device work a failed step left undone, in order
        self._device_work_due: list[DeviceWork] = []
        # one caller at a time: every public method holds it (re-entrant for stats())
        self._lock = threading.RLock()
        self._num_added = 0
        # metrics of the last finished requests, for stats(); bounded so that a
        # long-running server does not grow without end
        self.finished_metrics: collections.deque[RequestMetrics] = collections.deque(
            maxlen=FINISHED_METRICS_KEPT)
        self.peak_kv_usage = 0.0
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time inside step(), host and device
        # step_seconds by phase (ENGINE_PHASES; the runner times its own inside "device")
        self.timer = StepTimer(ENGINE_PHASES)
        gc_tuning.raise_threshold()  # a step's garbage, collected a few times a step, not 50

    @property
    def allocator(self) -> TieredAllocator:
        """The scheduler's block allocator (for stats and invariant checks)."""
        return self.scheduler.allocator

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (with `lora_request`, under that LoRA adapter). Raises ValueError
        (and changes nothing) on bad input: a request accepted here fits every shape it will
        be packed into and can always be admitted."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.scheduler.check_cache_salt(cache_salt)
        with self._lock:
            request_id = self._new_request_id(request_id)
            token_ids = self._prompt_token_ids(prompt)
            self._check_request(token_ids, params)
            matcher, bad_words = self._matcher(params), self._bad_words(params)
            if lora_request is not None:
                self.add_lora(lora_request)
            seed = params.seed if params.seed is not None else self._derive_seed(request_id)
            metrics = RequestMetrics(arrival_time=time.perf_counter())
            parent = Request(request_id, token_ids, params, seed, metrics,
                             prompt=prompt if isinstance(prompt, str) else None,
                             cache_salt=cache_salt, lora=lora_request,
                             matcher=matcher, bad_words=bad_words)
            if lora_request is not None:
                self.loras.hold(lora_request.lora_int_id)
            group = RequestGroup(request_id, params.n, [parent], forked=params.n == 1)
            parent.group = group
            self.requests[request_id] = group
            self.scheduler.add(parent)
            self._num_added += 1

    def add_beam_request(self, request_id: str, prompt: str | Sequence[int],
                         params: BeamSearchParams) -> None:
        """Queue a beam-search request; its output (the `beam_width` best hypotheses, best
        first) comes when it finishes."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        with self._lock:
            request_id = self._new_request_id(request_id)
            group = BeamGroup(request_id, params.beam_width, [], beam=params,
                              eos_token_ids=tuple(sorted(self.eos_token_ids)))
            if group.num_candidates > MAX_LOGPROBS:
                raise ValueError(f"beam_width must be <= {MAX_LOGPROBS // 2} (or "
                                 f"{MAX_LOGPROBS // 2} with ignore_eos), got {params.beam_width}")
            # beams draw nothing themselves: the sampler only reports each beam's top tokens
            sampling = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens,
                                      temperature=0.0, logprobs=group.num_candidates,
                                      ignore_eos=True)
            token_ids = self._prompt_token_ids(prompt)
            self._check_request(token_ids, sampling)
            root = Request(request_id, token_ids, sampling, 0,
                           RequestMetrics(arrival_time=time.perf_counter()),
                           prompt=prompt if isinstance(prompt, str) else None, group=group)
            group.samples.append(root)
            group.scores[id(root)] = 0.0
            self.requests[request_id] = group
            self.scheduler.add(root)

    # ---------------------------------------------------------------- LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Know a LoRA adapter (read and checked now: a ValueError naming what is wrong);
        False if it was known already. Requests name it by `lora_request`."""
        from jaxpage.lora import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self.loras is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} given, but LoRA is off: "
                             "build the engine with enable_lora=True")
        with self._lock:
            known = lora_request.lora_int_id in self.loras.known
            self.loras.add(lora_request)
            return not known

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False if unknown); a ValueError while requests use it."""
        with self._lock:
            if self.loras is None or lora_int_id not in self.loras.known:
                return False
            self.loras.remove(lora_int_id)
            self.scheduler.loras.release(lora_int_id)
            return True

    def list_loras(self) -> list[LoRARequest]:
        """The adapters known, by lora_int_id."""
        return [] if self.loras is None else [self.loras.known[i]
                                              for i in sorted(self.loras.known)]

    def _new_request_id(self, request_id: Any) -> str:
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def _prompt_token_ids(self, prompt: Any) -> list[int]:
        """A prompt's token ids: a string is tokenized; a sequence of integers (numpy ones
        too) is taken as token ids, each in [0, vocab_size)."""
        if isinstance(prompt, str):
            token_ids = self.tokenize(prompt)
        elif (isinstance(prompt, Sequence) and not isinstance(prompt, bytes)) or is_vector(prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        for t in token_ids:
            if not is_int(t) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), "
                                 f"got {t!r}")
        return [int(t) for t in token_ids]

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what could never be served: too long, more KV blocks than the pool has
        under the reservation policy, more samples than running slots, token ids the
        vocabulary does not have."""
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {t}")
        need, window_need = self.scheduler.blocks_needed(len(token_ids), total, params.n)
        if need > self.allocator.num_blocks - 1:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens (n={params.n}) needs {need} KV blocks "
                f"under reservation_policy {self.config.reservation_policy!r} but the pool has "
                f"only {self.allocator.num_blocks - 1}; raise num_blocks or lower max_tokens"
            )
        if self.scheduler.windowed:
            group = self.allocator.window_group
            if window_need > group.num_blocks - 1:
                raise ValueError(
                    f"n={params.n} samples need up to {window_need} blocks of the "
                    f"sliding-window layers' pool, which has {group.num_blocks - 1}; raise "
                    f"num_window_blocks")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.config.max_num_seqs}), "
                             f"got {params.n}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            for t in ids:
                if t >= self.vocab_size:
                    raise ValueError(f"{name} token ids must be in [0, {self.vocab_size}), "
                                     f"got {t}")

    def _matcher(self, params: SamplingParams):
        """A structured output's matcher in its start state (None: no constraint); a
        ValueError naming the field when the constraint does not compile."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            from jaxpage.structured import Grammars

            self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self.grammars.matcher(params.structured_outputs)

    def _bad_words(self, params: SamplingParams) -> list[tuple[int, ...]] | None:
        if not params.bad_words:
            return None
        from jaxpage.structured import bad_words_token_ids

        return bad_words_token_ids(self.tokenizer, params.bad_words) or None

    def _derive_seed(self, request_id: str) -> int:
        digest = hashlib.sha256(f"{self.config.seed}:{self._num_added}:{request_id}".encode())
        return int.from_bytes(digest.digest()[:4], "little")

    def abort_request(self, request_id: str) -> None:
        """End a request wherever it is (waiting, running, preempted): every one of its
        samples ends with finish_reason "abort" and all their blocks are freed."""
        with self._lock:
            group = self.requests.get(str(request_id))
            if group is None:
                return
            aborted = [s for s in group.samples if not s.finished]
            for sample in aborted:
                self.scheduler.finish(sample, "abort")
            if isinstance(group, BeamGroup):
                group.done = True
            self._pending.append(self._final_output(group, "abort", aborted))
            self._release(group)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.num_unfinished > 0 or bool(self._pending)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. between benchmark runs, or after new weights are
        loaded). Refused (False) while requests hold blocks."""
        with self._lock:
            return not self.has_unfinished_requests() and self.allocator.reset_prefix_cache()

    def warmup(self, shapes: int | None = None) -> tuple[int, float]:
        """Compile the step shapes a server meets first (the runner's `warmup`; the first
        `shapes` of them, if given), before any request; returns (compilations, seconds).
        Its steps are no engine steps: the runner's phase times start after it."""
        with self._lock:
            result = self.runner.warmup(shapes)
            self.runner.timer.reset()
            return result

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step.

        Returns one RequestOutput per request that produced new text or finished this step
        (and for requests aborted since the last step). Outputs carry deltas: the new
        tokens and text of this step; `finished` marks the last one.

        A step is all or nothing for each request. A failure that belongs to one request
        (admitting it, growing its blocks, appending or detokenizing its tokens) ends that
        request alone: its output has finish_reason "abort" and `error` set, and the step
        goes on for the others. A failure of the device work (block copies, the forward,
        the sampler) raises here after putting the engine back as it was before the step:
        no token was appended, no K/V counted as written, swaps and copy-on-write copies
        are redone first by the next step, and if the KV pool itself was lost, every
        running request is preempted to recompute (as is a swapped-out one whose copy to
        the host never ran). No request is lost; the next step() goes on.
        """
        with self._lock:
            timer = self.timer
            start = timer.start()
            outputs, self._pending = self._pending, []
            scheduled = self.scheduler.schedule()
            outputs += self._failure_outputs()
            if not (scheduled.chunks or scheduled.swap_out):  # planned copies always run
                return outputs
            timer.mark("schedule")  # of a step that runs: an idle one is no step
            compiles, device_start = self.runner.compiles, time.perf_counter()
            try:
                results = self._run_device(scheduled)
            except Exception:
                self._pending = outputs  # reported by the next step
                raise
            timer.mark("device")
            step_cost = self.scheduler.step_cost
            if (step_cost is not None and self.runner.compiles == compiles
                    and all(c.num_new_tokens == 1 + len(c.draft_tokens)
                            for c in scheduled.chunks)):  # decodes, some with drafts
                step_cost.observe(scheduled.num_batched_tokens,
                                  any(c.draft_tokens for c in scheduled.chunks),
                                  time.perf_counter() - device_start)
            # peak KV use: with this step's blocks, before finished requests free theirs
            self.peak_kv_usage = max(self.peak_kv_usage, self.allocator.usage()["usage"])
            detokenize = self._detokenize if self.tokenizer is not None else None
            update = self.scheduler.update(scheduled, results, detokenize)
            self.num_steps += 1
            timer.mark("update")
            for group in update.finished_beams:
                outputs.append(beam_output(group, "length", self.tokenizer))
                self._release(group)
            for group, starts in update.new_tokens.items():
                if group.error is not None:
                    continue  # failed in update: reported below
                params = group.samples[0].params
                final_only = params.output_kind is _FINAL_ONLY
                if final_only and not params.stop:  # no text wanted before the end
                    if not group.finished:
                        continue
                    starts = group.samples  # every sample's text, caught up
                if detokenize is not None:
                    try:
                        for sample in starts:
                            detokenize(sample)
                    except Exception as exc:
                        self.scheduler.fail(group, exc)
                        continue
                finished = group.finished
                if final_only and not finished:
                    continue
                outputs.append(sample_deltas(group, starts, self._detokenizers, finished))
                if finished:
                    self._release(group)
            outputs += self._failure_outputs()
            timer.mark("outputs")
            self.step_seconds += time.perf_counter() - start
            return outputs

    def _run_device(self, scheduled: SchedulerOutput) -> list:
        """The step's device work, in this order: swap-outs (they read blocks this step may
        hand out again), NaN refills (debug), swap-ins, copy-on-write copies, then the
        forward and the sampler. Work a failed step left undone runs first, in its own
        order, so every block is read before anything rewrites it and every host block is
        written before it is read. A swap-out's transfer to the host overlaps the forward
        and lands after it (or before a swap-in of the same step). On failure nothing the
        host recorded is lost: the undone work is kept for the next step, and a lost pool
        is rebuilt."""
        released = window_released = []
        if self.config.debug_nan_pool:
            released = self.allocator.take_released()
            if self.scheduler.windowed:
                window_released = self.allocator.take_window_released()
        nan = float("nan")
        work = self._device_work_due
        planned = (SwapOut(scheduled.swap_out), FillBlocks(released, nan),
                   FillBlocks(window_released, nan, True), SwapIn(scheduled.swap_in),
                   CopyBlocks(scheduled.block_copies),
                   CopyBlocks(scheduled.window_copies, True))
        work += [item for item in planned if item.blocks]  # an item with no blocks: no call
        work += [LoadLoRA(slot, self.loras.weights(lora_id))
                 for slot, lora_id in scheduled.lora_loads]
        try:
            while work:  # each item leaves the list once done (a swap-out: once dispatched)
                work[0].run(self.runner)
                work.pop(0)
            compiles, start = self.runner.compiles, time.perf_counter()
            results = self.runner.execute(scheduled.seqs) if scheduled.seqs else []
        except Exception:
            with contextlib.suppress(Exception):  # the step's own error is the one to raise
                self._land_swaps()
            if self.runner.pool_lost():
                self._rebuild_pool()
            raise
        self._land_swaps()
        if self.swap_cost is not None:
            self.swap_cost.observe_copies(self.runner.swap_out_bytes_timed,
                                          self.runner.swap_out_seconds_timed)
            if self.runner.compiles == compiles and any(
                    len(seq.token_ids) > 1 for seq in scheduled.seqs):
                self.swap_cost.record_prefill(scheduled.num_batched_tokens,
                                              time.perf_counter() - start)
        return results

    def _land_swaps(self) -> None:
        """Land the swap-outs in flight in the host pool. Their gathers read the pool before
        the forward, so what lands is right even after a failed step; if they cannot land,
        their copies are lost (the forward may since have rewritten those blocks): the pool
        is rebuilt as when it is lost, the requests they held recomputing, and the error
        raised."""
        try:
            self.runner.finish_swaps()
        except Exception:
            self._device_work_due[:0] = [SwapOut(copies) for copies in self.runner.drop_swaps()]
            self._rebuild_pool()
            raise

    def _rebuild_pool(self) -> None:
        """The device freed the donated pool mid-step: every K/V in it is gone. Start a new
        pool, send every running request back to recompute, and forget the device prefix
        cache. The host pool keeps its contents, except blocks whose swap-out had not run
        yet: the swapped-out requests holding one go back to recompute too."""
        unwritten = [host_id for item in self._device_work_due if isinstance(item, SwapOut)
                     for _, host_id in item.copies]
        self._device_work_due = []  # LoRA slot writes too: every slot is forgotten below
        self.runner.reset_pool()
        self.scheduler.pool_lost(unwritten)
        self.allocator.take_released()  # the new pool holds nothing stale

    def _failure_outputs(self) -> list[RequestOutput]:
        """Abort outputs, with the error, of requests a failure ended."""
        outputs = []
        for group in self.scheduler.take_failed():
            if self.requests.get(group.request_id) is not group:
                continue  # already released
            out = self._final_output(group, "abort", group.samples)  # every sample's end
            out.error = group.error
            outputs.append(out)
            self._release(group)
        return outputs

    def _final_output(self, group: RequestGroup, reason: str,
                      ended: list[Request] = ()) -> RequestOutput:
        """The last output of a request: a beam group's hypotheses, or the final (empty)
        deltas of the samples that were just `ended`."""
        if isinstance(group, BeamGroup):
            return beam_output(group, reason, self.tokenizer)
        params = group.samples[0].params
        if (params.output_kind is _FINAL_ONLY and not params.stop
                and self.tokenizer is not None):  # its text, not made as it ran
            with contextlib.suppress(Exception):  # (what failed may be this): as it stands
                for sample in group.samples:
                    self._detokenize(sample)
        return sample_deltas(group, {s: s.num_output_tokens for s in ended},
                             self._detokenizers)

    def _detokenize(self, sample: Request) -> None:
        """Extend the sample's text by its new token; a stop string in it ends the sample
        (over a "length" end on the same token, as vLLM reports it). Needs a tokenizer."""
        p = sample.params
        detok = self._detokenizers.get(sample.seq_id)
        if detok is None:
            detok = self._detokenizers[sample.seq_id] = IncrementalDetokenizer(
                self.tokenizer, sample.num_prompt_tokens, p.stop, self._text_decoder)
        stop = detok.update(sample.token_ids, bool(p.stop) and (  # no stop strings: no search
            sample.num_output_tokens >= p.min_tokens), sample.status is _FINISHED)
        sample.text = detok.text
        if stop is not None and sample.finish_reason in (None, "length"):
            self.scheduler.finish(sample, "stop", stop)

    def _release(self, group: RequestGroup) -> None:
        metrics = group.samples[0].metrics
        metrics.finished_time = time.perf_counter()
        if isinstance(group, BeamGroup):  # the hypotheses returned, not the live beams
            lengths = [len(h.token_ids) for h in group.best()]
        else:
            lengths = [s.num_output_tokens for s in group.samples]
        metrics.num_output_tokens = max(lengths, default=0)
        self.finished_metrics.append(metrics)
        del self.requests[group.request_id]
        lora = group.samples[0].lora if group.samples else None
        if lora is not None:
            self.loras.let_go(lora.lora_int_id)
        for sample in group.samples:
            self._detokenizers.pop(sample.seq_id, None)

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self._stats()

    def step_phases(self) -> dict[str, float]:
        """Seconds of the steps so far (`step_seconds`) by phase, in step order: schedule;
        the runner's prepare, compile, dispatch, wait and readback inside its execute;
        "device_other", the rest of the device call (block copies, swaps and their landing,
        the runner's own bookkeeping); update; outputs (detokenizing, stop strings, the
        outputs). A step that raised counts the phases it went through."""
        engine, runner = self.timer.seconds, self.runner.timer.seconds
        phases = {"schedule": engine["schedule"]}
        phases.update((phase, runner[phase]) for phase in RUNNER_PHASES)
        phases["device_other"] = engine["device"] - sum(runner.values())
        phases["update"], phases["outputs"] = engine["update"], engine["outputs"]
        return phases

    def _stats(self) -> dict[str, Any]:
        usage = self.allocator.usage()
        ttft = [m.ttft for m in self.finished_metrics if m.ttft is not None]
        tpot = [m.tpot for m in self.finished_metrics if m.tpot is not None]
        return {
            "kv_blocks_total": usage["num_blocks"],
            "kv_blocks_used": usage["used"],
            "kv_usage": usage["usage"],
            "kv_peak_usage": self.peak_kv_usage,
            # per kind of layer; sliding layers hold a token only while it is in the window
            "kv_bytes_per_token": dict(self.runner.kv_bytes_per_token),
            "kv_cache_dtype": self.runner.kv_dtype.name,
            # the params' bytes as loaded, and of those the 8-bit projections' (values and
            # scales), in the format `quantization` (EngineConfig.quantization, or as the
            # checkpoint stored them; None: full width)
            "weight_bytes": self.runner.weight_bytes,
            "quantized_weight_bytes": self.runner.quantized_weight_bytes,
            "quantization": self.runner.quantization,
            "sliding_window": self.runner.window,
            "kv_window_blocks_total": usage.get("window_num_blocks", 0),
            "kv_window_blocks_used": usage.get("window_used", 0),
            "prefix_cache_queries": usage["prefix_cache_queries"],
            "prefix_cache_hits": usage["prefix_cache_hits"],
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped_preemptions": self.scheduler.num_swapped_preemptions,
            "swap_out_blocks": self.runner.swap_out_blocks,
            "swap_in_blocks": self.runner.swap_in_blocks,
            "prefix_cache_host_hits": usage["prefix_cache_host_hits"],
            "host_blocks_total": usage["host_blocks"],
            "host_blocks_used": usage["host_used"],
            "host_blocks_cached": usage["host_cached"],
            "compiles": self.runner.compiles,
            "compile_seconds": self.runner.compile_seconds,
            "num_steps": self.num_steps,
            "step_seconds": self.step_seconds,
            "device_seconds": self.runner.device_seconds,
            "step_phases": self.step_phases(),
            # decode steps the runner had started before the step they follow was read
            # back, and steps so started that were not the scheduler's next (run anew)
            "lookahead_hits": self.runner.lookahead_hits,
            "lookahead_misses": self.runner.lookahead_misses,
            # of the hits, steps whose other rows ran in a call of their own; rows run ahead
            # that were not taken (their sequence had ended)
            "lookahead_split": self.runner.lookahead_split,
            "lookahead_dropped": self.runner.lookahead_dropped,
            "ttft": _summary(ttft),
            "tpot": _summary(tpot),
            # speculative decoding's acceptance (jaxpage.engine.speculative.SpecStats), or
            # None with it off
            "spec_decode": (self.scheduler.spec_stats.summary()
                            if self.config.speculative_config is not None else None),
            # multi-LoRA, or None with it off: adapters known, holding device slots (least
            # recently used first) and read in host memory, and the slot writes so far
            "lora": None if self.loras is None else {
                "known": len(self.loras.known),
                "resident": self.scheduler.loras.resident(),
                "in_host_memory": self.loras.read_ids(),
                "slot_writes": self.scheduler.loras.num_loads},
        }


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "count": 0}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "count": len(values)}

