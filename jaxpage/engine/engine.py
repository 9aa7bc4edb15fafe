"""LLMEngine: requests in, one scheduled and executed step at a time, outputs out.

The engine validates requests where they enter, asks the scheduler what to run, hands the
runner plain arrays, then appends the drawn tokens, detokenizes incrementally, checks stop
conditions and frees finished requests' blocks. It does no device math itself.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpage.attention import kv_bytes_per_block
from jaxpage.config import EngineConfig
from jaxpage.engine.beam_search import BeamGroup
from jaxpage.engine.block_allocator import BlockAllocator
from jaxpage.engine.detokenizer import IncrementalDetokenizer
from jaxpage.engine.output_builder import beam_output, sample_deltas
from jaxpage.engine.request import Request, RequestGroup
from jaxpage.engine.runner import ModelRunner, SamplingRow, SeqInput
from jaxpage.engine.scheduler import Scheduler
from jaxpage.outputs import RequestMetrics, RequestOutput
from jaxpage.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams, sample_seed
from pallas_kernels import cpu_attention

_CPU_KV_BUDGET = 1 << 30  # default KV pool on CPU: 1 GiB


def _pick_backend(requested: str, interpret: bool, *, head_dim: int, block_size: int,
                  dtype) -> str:
    """The attention backend: "auto" is the platform's Pallas decode kernel on TPU and GPU,
    and on CPU the C++ kernel where it serves the pool (float32, built on this machine), else
    the blockwise jnp path. A kernel forced onto another platform needs interpret."""
    platform = jax.default_backend()
    if requested == "auto":
        if platform == "cpu":
            usable = cpu_attention.unsupported_reason(head_dim, block_size, dtype) is None
            return "cpp" if usable else "jnp"
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "jnp")
    if requested == "cpp":
        if platform != "cpu":
            raise ValueError(f"attention_backend 'cpp' runs on the CPU (this is {platform!r})")
        reason = cpu_attention.unsupported_reason(head_dim, block_size, dtype)
        if reason is not None:
            raise ValueError(f"attention_backend 'cpp' cannot serve this model: {reason}")
        return requested
    native = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(requested)
    if native is not None and native != platform and not interpret:
        raise ValueError(f"attention_backend {requested!r} needs a {native.upper()} (this is "
                         f"{platform!r}); set kernel_interpret=True to run it interpreted")
    return requested


class LLMEngine:
    """Continuous-batching engine over one model.

    `model` is any object with a `config` (num_layers, num_kv_heads, head_dim, vocab_size,
    max_position_embeddings) and `forward(params, token_ids, positions, kv_pool, metadata)`.
    """

    def __init__(self, config: EngineConfig, model: Any, params: Any, tokenizer: Any = None):
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
        dtype = jax.numpy.dtype(config.dtype)
        num_blocks = self._num_blocks(model_config, dtype)
        self.allocator = BlockAllocator(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            policy=config.reservation_policy, max_model_len=self.max_model_len,
        )
        self.scheduler = Scheduler(
            self.allocator, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.runner = ModelRunner(
            model, jax.tree.map(lambda a: _cast_float(a, dtype), params),
            num_blocks=num_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, dtype=dtype,
            backend=_pick_backend(config.attention_backend, config.kernel_interpret,
                                  head_dim=model_config.head_dim,
                                  block_size=config.block_size, dtype=dtype),
            interpret=config.kernel_interpret,
        )
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts between steps
        self._num_added = 0
        self.finished_metrics: list[tuple[RequestMetrics, int]] = []
        self.peak_kv_usage = 0.0
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time inside step(), host and device

    # ---------------------------------------------------------------- sizing
    def _num_blocks(self, model_config: Any, dtype) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        per_block = kv_bytes_per_block(model_config.num_layers, self.config.block_size,
                                       model_config.num_kv_heads, model_config.head_dim, dtype)
        budget = self.config.kv_cache_memory
        if budget is None:
            budget = _CPU_KV_BUDGET
            stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
            if stats and "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                budget = int(free * self.config.gpu_memory_utilization)
        num_blocks = budget // per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory {budget} bytes holds {num_blocks} blocks of "
                             f"{per_block} bytes; need at least 2")
        return int(num_blocks)

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
        self._add_detokenizer(parent)
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

    def _add_detokenizer(self, request: Request) -> None:
        if self.tokenizer is not None:
            self._detokenizers[request.seq_id] = IncrementalDetokenizer(
                self.tokenizer, request.num_prompt_tokens, request.params.stop)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        for t in token_ids:
            if not isinstance(t, int | np.integer) or isinstance(t, bool) or not (
                    0 <= t < self.vocab_size):
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
        results = self.runner.execute([self._seq_input(chunk) for chunk in scheduled.chunks])
        self.scheduler.commit(scheduled)
        self.num_steps += 1
        self.peak_kv_usage = max(self.peak_kv_usage, self.allocator.usage()["usage"])
        now = time.perf_counter()
        changed: dict[RequestGroup, dict[Request, int]] = {}  # sample -> first new token
        for victim in scheduled.preempted:  # its draw will be recomputed
            if isinstance(victim.group, BeamGroup):
                victim.group.pending.pop(victim, None)
        beam_groups: dict[BeamGroup, None] = {}
        for chunk, draws in zip(scheduled.chunks, results, strict=True):
            if not draws:
                continue
            request = chunk.request
            if isinstance(request.group, BeamGroup):
                request.group.pending[request] = draws[0]
                beam_groups[request.group] = None
                continue
            samples = [request]
            if len(draws) > 1:  # end of the prompt's prefill: fork the other samples
                samples += self._fork(request, len(draws) - 1)
            for sample, draw in zip(samples, draws, strict=True):
                changed.setdefault(sample.group, {})[sample] = sample.num_output_tokens
                self._append_token(sample, draw, now)
        for group in beam_groups:
            if group.ready():
                group.advance(self.scheduler)
                if group.finished:
                    outputs.append(beam_output(group, "length", self.tokenizer))
                    self._release(group)
        for group, starts in changed.items():
            outputs.append(sample_deltas(group, starts, self._detokenizers))
            if group.finished:
                self._release(group)
        self.step_seconds += time.perf_counter() - start
        return outputs

    def _fork(self, parent: Request, count: int) -> list[Request]:
        """Samples 1..count of `parent`'s request: each shares every block of the prompt
        (copy-on-write of the partly filled last one happens on its first write)."""
        children = []
        for index in range(1, count + 1):
            child = Request(parent.request_id, parent.prompt_token_ids, parent.params,
                            sample_seed(parent.seed, index), parent.metrics,
                            prompt=parent.prompt, cache_salt=parent.cache_salt,
                            sample_index=index, group=parent.group)
            self.scheduler.add_fork(parent, child)
            self._add_detokenizer(child)
            parent.group.samples.append(child)
            children.append(child)
        parent.group.forked = True
        return children

    def _seq_input(self, chunk) -> SeqInput:
        request = chunk.request
        start = chunk.num_computed_tokens
        sampling = []
        if chunk.sample:
            p = request.params
            banned: tuple[int, ...] = ()
            if request.num_output_tokens < p.min_tokens:
                banned = tuple(sorted(set(p.stop_token_ids) | (
                    set() if p.ignore_eos else self.eos_token_ids)))
            # one row per sample still to fork from this prompt, with its own seed
            seeds = [request.seed] + [sample_seed(request.seed, i)
                                      for i in range(1, request.num_draws)]
            sampling = [SamplingRow(
                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                seed=seed, step=request.num_output_tokens,
                presence=p.presence_penalty, frequency=p.frequency_penalty,
                repetition=p.repetition_penalty,
                num_logprobs=0 if p.logprobs is None else max(p.logprobs, 1),
                prompt_token_ids=request.prompt_token_ids if p.uses_penalties else None,
                output_token_ids=request.output_token_ids if p.uses_penalties else None,
                banned_token_ids=banned,
            ) for seed in seeds]
        return SeqInput(chunk.block_table, start,
                        request.token_ids[start : start + chunk.num_new_tokens], sampling)

    def _append_token(self, request: Request, result, now: float) -> None:
        p = request.params
        token = result.token
        request.token_ids.append(token)
        request.cumulative_logprob += result.logprob
        if request.logprobs is not None:
            entry = dict(list((result.top_logprobs or {}).items())[: p.logprobs])
            entry[token] = result.logprob
            request.logprobs.append(entry)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        num_out = request.num_output_tokens
        stop_string = None
        detok = self._detokenizers.get(request.seq_id)
        if detok is not None:
            stop_string = detok.update(request.token_ids, check_stop=num_out >= p.min_tokens)
            request.text = detok.text
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self.scheduler.finish(request, "stop")
            if token in p.stop_token_ids:
                return self.scheduler.finish(request, "stop", token)
            if stop_string is not None:
                return self.scheduler.finish(request, "stop", stop_string)
        if num_out >= p.max_tokens or request.num_tokens >= self.max_model_len:
            self.scheduler.finish(request, "length")

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


def _cast_float(leaf: Any, dtype) -> Any:
    """Cast floating-point params to the engine dtype (no copy when the loader already made
    them that dtype); leave integer buffers and keys alone."""
    array = np.asarray(leaf) if not hasattr(leaf, "dtype") else leaf
    if jax.numpy.issubdtype(array.dtype, jax.numpy.floating):
        return np.asarray(array).astype(dtype, copy=False)
    return array


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "count": 0}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "count": len(values)}

