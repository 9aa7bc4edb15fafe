"""LLMEngine: requests in, one scheduled and executed step at a time, outputs out.

The engine validates requests where they enter, asks the scheduler what to run, hands the
runner the scheduler's plain lists, gives the results back to the scheduler (which appends
the tokens, forks, advances beams and ends sequences on EOS, stop tokens and lengths), then
detokenizes, ends sequences on stop strings and builds the outputs. It imports no JAX and
does no device math: the runner (`jaxpage.engine.runner`, or any object with its
interface) owns the device.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpage.engine.beam_search import BeamGroup
from jaxpage.engine.detokenizer import IncrementalDetokenizer
from jaxpage.engine.output_builder import beam_output, sample_deltas
from jaxpage.engine.request import Request, RequestGroup
from jaxpage.engine.scheduler import Scheduler
from jaxpage.outputs import RequestMetrics, RequestOutput
from jaxpage.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from jaxpage.validation import is_int

if TYPE_CHECKING:
    from jaxpage.config import EngineConfig
    from jaxpage.engine.block_allocator import BlockAllocator


class LLMEngine:
    """Continuous-batching engine over one model.

    `model` is any object with a `config` (num_layers, num_kv_heads, head_dim, vocab_size,
    max_position_embeddings) and `forward(params, token_ids, positions, kv_pool, metadata)`.
    """

    def __init__(self, config: EngineConfig, model: Any, params: Any, tokenizer: Any = None,
                 *, runner: Any = None):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        model_config = model.config
        limit = model_config.max_position_embeddings
        window = getattr(model_config, "sliding_window", None)
        if window:
            limit = min(limit, window)  # the window never binds below its own length
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len must be <= the model's limit {limit}, "
                             f"got {config.max_model_len}")
        self.max_model_len = config.max_model_len or limit
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = set(getattr(model_config, "eos_token_ids", ()) or ())
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        if runner is None:  # the device side, imported here so this module imports no JAX
            from jaxpage.engine.runner import ModelRunner

            runner = ModelRunner(model, params, config, max_model_len=self.max_model_len)
        self.runner = runner
        self.scheduler = Scheduler(
            num_blocks=runner.num_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            reservation_policy=config.reservation_policy, eos_token_ids=self.eos_token_ids,
        )
        self.requests: dict[str, RequestGroup] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts between steps
        self._num_added = 0
        self.finished_metrics: list[tuple[RequestMetrics, int]] = []
        self.peak_kv_usage = 0.0
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time inside step(), host and device

    @property
    def allocator(self) -> BlockAllocator:
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
    ) -> None:
        """Queue a request. Raises ValueError (and changes nothing) on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, params)
        seed = params.seed if params.seed is not None else self._derive_seed(request_id)
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        parent = Request(request_id, token_ids, params, seed, metrics, prompt=text,
                         cache_salt=cache_salt)
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
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = BeamGroup(request_id, params.beam_width, [], beam=params,
                          eos_token_ids=tuple(sorted(self.eos_token_ids)))
        if group.num_candidates > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be <= {MAX_LOGPROBS // 2} (or "
                             f"{MAX_LOGPROBS // 2} with ignore_eos), got {params.beam_width}")
        # beams draw nothing themselves: the sampler only reports each beam's top tokens
        sampling = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens,
                                  temperature=0.0, logprobs=group.num_candidates,
                                  ignore_eos=True)
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, sampling)
        root = Request(request_id, token_ids, sampling, 0,
                       RequestMetrics(arrival_time=time.perf_counter()),
                       prompt=prompt if isinstance(prompt, str) else None, group=group)
        group.samples.append(root)
        group.scores[id(root)] = 0.0
        self.requests[request_id] = group
        self.scheduler.add(root)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        for t in token_ids:
            if not is_int(t) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), "
                                 f"got {t!r}")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        # the prompt once, then every sample's own blocks (its last prompt block copied)
        bs = self.config.block_size
        need = -(-total // bs) + (params.n - 1) * (-(-total // bs) - len(token_ids) // bs)
        if need > self.allocator.num_blocks - 1:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens (n={params.n}) needs {need} KV blocks but "
                f"the pool has only {self.allocator.num_blocks - 1}; raise num_blocks or lower "
                "max_tokens"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.config.max_num_seqs}), "
                             f"got {params.n}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")

    def _derive_seed(self, request_id: str) -> int:
        digest = hashlib.sha256(f"{self.config.seed}:{self._num_added}:{request_id}".encode())
        return int.from_bytes(digest.digest()[:4], "little")

    def abort_request(self, request_id: str) -> None:
        """End a request wherever it is (waiting, running, preempted): every one of its
        samples ends with finish_reason "abort" and all their blocks are freed."""
        group = self.requests.get(str(request_id))
        if group is None:
            return
        if isinstance(group, BeamGroup):
            for beam in [b for b in group.samples if not b.finished]:
                self.scheduler.finish(beam, "abort")
            group.done = True
            self._pending.append(beam_output(group, "abort", self.tokenizer))
            self._release(group)
            return
        aborted = [s for s in group.samples if not s.finished]
        for sample in aborted:
            self.scheduler.finish(sample, "abort")
        starts = {s: s.num_output_tokens for s in aborted}
        self._pending.append(sample_deltas(group, starts, self._detokenizers))
        self._release(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. between benchmark runs, or after new weights are
        loaded). Refused (False) while requests hold blocks."""
        return not self.has_unfinished_requests() and self.allocator.reset_prefix_cache()

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step.

        Returns one RequestOutput per request that produced new text or finished this step
        (and for requests aborted since the last step). Outputs carry deltas: the new
        tokens and text of this step; `finished` marks the last one.
        """
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return outputs
        self.runner.copy_blocks(scheduled.block_copies)
        results = self.runner.execute(scheduled.seqs)
        # peak KV use: with this step's blocks, before finished requests free theirs
        self.peak_kv_usage = max(self.peak_kv_usage, self.allocator.usage()["usage"])
        update = self.scheduler.update(scheduled, results)
        self.num_steps += 1
        for group in update.finished_beams:
            outputs.append(beam_output(group, "length", self.tokenizer))
            self._release(group)
        for group, starts in update.new_tokens.items():
            for sample in starts:
                self._detokenize(sample)
            outputs.append(sample_deltas(group, starts, self._detokenizers))
            if group.finished:
                self._release(group)
        self.step_seconds += time.perf_counter() - start
        return outputs

    def _detokenize(self, sample: Request) -> None:
        """Extend the sample's text by its new token; a stop string in it ends the sample
        (over a "length" end on the same token, as vLLM reports it)."""
        if self.tokenizer is None:
            return
        detok = self._detokenizers.get(sample.seq_id)
        if detok is None:
            detok = self._detokenizers[sample.seq_id] = IncrementalDetokenizer(
                self.tokenizer, sample.num_prompt_tokens, sample.params.stop)
        p = sample.params
        stop = detok.update(sample.token_ids,
                            check_stop=sample.num_output_tokens >= p.min_tokens)
        sample.text = detok.text
        if stop is not None and sample.finish_reason in (None, "length"):
            self.scheduler.finish(sample, "stop", stop)

    def _release(self, group: RequestGroup) -> None:
        metrics = group.samples[0].metrics
        metrics.finished_time = time.perf_counter()
        self.finished_metrics.append((metrics, max(s.num_output_tokens for s in group.samples)))
        del self.requests[group.request_id]
        for sample in group.samples:
            self._detokenizers.pop(sample.seq_id, None)

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        usage = self.allocator.usage()
        ttft = [m.ttft for m, _ in self.finished_metrics if m.ttft is not None]
        tpot = [(m.finished_time - m.first_token_time) / (n - 1)
                for m, n in self.finished_metrics
                if n > 1 and m.first_token_time is not None and m.finished_time is not None]
        return {
            "kv_blocks_total": usage["num_blocks"],
            "kv_blocks_used": usage["used"],
            "kv_usage": usage["usage"],
            "kv_peak_usage": self.peak_kv_usage,
            "prefix_cache_queries": usage["prefix_cache_queries"],
            "prefix_cache_hits": usage["prefix_cache_hits"],
            "num_preemptions": self.scheduler.num_preemptions,
            "compiles": self.runner.compiles,
            "compile_seconds": self.runner.compile_seconds,
            "num_steps": self.num_steps,
            "step_seconds": self.step_seconds,
            "device_seconds": self.runner.device_seconds,
            "ttft": _summary(ttft),
            "tpot": _summary(tpot),
        }


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "count": 0}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "count": len(values)}

