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

from jaxpage.config import EngineConfig
from jaxpage.engine.block_allocator import BlockAllocator
from jaxpage.engine.detokenizer import IncrementalDetokenizer
from jaxpage.engine.request import Request
from jaxpage.engine.runner import ModelRunner, SamplingRow, SeqInput
from jaxpage.engine.scheduler import Scheduler
from jaxpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpage.sampling_params import SamplingParams

_CPU_KV_BUDGET = 1 << 30  # default KV pool on CPU: 1 GiB


def _pick_backend(requested: str) -> str:
    """The attention backend to run. The Pallas decode kernels are not built yet, so "auto"
    is the blockwise jnp path on every platform and forcing a kernel is refused."""
    if requested in ("pallas_gpu", "pallas_tpu"):
        raise ValueError(f"attention_backend {requested!r} is not available yet; use 'auto', "
                         "'jnp' or 'reference'")
    return "jnp" if requested == "auto" else requested


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
            model, jax.tree.map(lambda a: np.asarray(a).astype(dtype), params),
            num_blocks=num_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, dtype=dtype,
            backend=_pick_backend(config.attention_backend),
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
        from jaxpage.attention import kv_bytes_per_block

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
        if params.n != 1:
            raise ValueError(f"n must be 1 for now (parallel sampling is not built yet), "
                             f"got {params.n}")
        seed = params.seed if params.seed is not None else self._derive_seed(request_id)
        request = Request(request_id, token_ids, params, seed,
                          RequestMetrics(arrival_time=time.perf_counter()), prompt=text,
                          cache_salt=cache_salt)
        self.requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, len(token_ids), params.stop)
        self.scheduler.add(request)
        self._num_added += 1

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
        need = -(-total // self.config.block_size)
        if need > self.allocator.num_blocks - 1:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens needs {need} KV blocks but the pool has "
                f"only {self.allocator.num_blocks - 1}; raise num_blocks or lower max_tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")

    def _derive_seed(self, request_id: str) -> int:
        digest = hashlib.sha256(f"{self.config.seed}:{self._num_added}:{request_id}".encode())
        return int.from_bytes(digest.digest()[:4], "little")

    def abort_request(self, request_id: str) -> None:
        """End a request wherever it is (waiting, running, preempted); its blocks are freed."""
        request = self.requests.get(str(request_id))
        if request is None or request.finished:
            return
        self.scheduler.finish(request, "abort")
        self._pending.append(self._output(request, finished=True))
        self._release(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

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
        for chunk, result in zip(scheduled.chunks, results, strict=True):
            if result is None:
                continue
            request = chunk.request
            start_token = request.num_output_tokens
            self._append_token(request, result, now)
            if request.finished:
                self._release(request)
            outputs.append(self._output(request, request.finished, delta_from=start_token))
        self.step_seconds += time.perf_counter() - start
        return outputs

    def _seq_input(self, chunk) -> SeqInput:
        request = chunk.request
        start = chunk.num_computed_tokens
        sampling = None
        if chunk.sample:
            p = request.params
            banned: tuple[int, ...] = ()
            if request.num_output_tokens < p.min_tokens:
                banned = tuple(sorted(set(p.stop_token_ids) | (
                    set() if p.ignore_eos else self.eos_token_ids)))
            sampling = SamplingRow(
                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                seed=request.seed, step=request.num_output_tokens,
                presence=p.presence_penalty, frequency=p.frequency_penalty,
                repetition=p.repetition_penalty,
                num_logprobs=0 if p.logprobs is None else max(p.logprobs, 1),
                prompt_token_ids=request.prompt_token_ids if p.uses_penalties else None,
                output_token_ids=request.output_token_ids if p.uses_penalties else None,
                banned_token_ids=banned,
            )
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
        detok = self._detokenizers.get(request.request_id)
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

    def _release(self, request: Request) -> None:
        request.metrics.finished_time = time.perf_counter()
        self.finished_metrics.append((request.metrics, request.num_output_tokens))
        del self.requests[request.request_id]
        self._detokenizers.pop(request.request_id, None)

    def _output(self, request: Request, finished: bool, delta_from: int = 0) -> RequestOutput:
        detok = self._detokenizers.get(request.request_id)
        text = detok.streamable_text(finished) if detok is not None else request.text
        start_char = request.num_text_emitted
        request.num_text_emitted = max(len(text), start_char)
        completion = CompletionOutput(
            index=0,
            text=text[start_char:],
            token_ids=request.output_token_ids[delta_from:],
            cumulative_logprob=request.cumulative_logprob,
            logprobs=None if request.logprobs is None else request.logprobs[delta_from:],
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [completion], finished, request.metrics)

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

