"""Data parallelism: independent engine replicas on disjoint devices behind one engine.

`data_parallel_size` replicas, each an LLMEngine with its own scheduler, allocator and KV
pool on its own `tensor_parallel_size` devices (row r of a `("data", "model")` device
grid). A new request goes to the replica whose prefix cache holds the longest prefix of its
prompt, else to the least loaded one; it stays there. A step steps every busy replica, each
on its own thread (the device work of one overlaps the host work of another).

`build_engine(config, ...)` gives a plain LLMEngine when data_parallel_size is 1.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

from jaxpage.engine.engine import LLMEngine, _summary
from jaxpage.outputs import RequestOutput

_SUMMED = ("kv_blocks_total", "kv_blocks_used", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "compiles", "compile_seconds", "num_steps", "step_seconds",
           "device_seconds", "num_running", "num_waiting", "lookahead_hits",
           "lookahead_misses", "lookahead_split", "lookahead_dropped")


def build_engine(config: Any, model: Any, params: Any, tokenizer: Any = None) -> Any:
    """The engine `config` describes: one LLMEngine, or `data_parallel_size` replicas."""
    if config.data_parallel_size == 1:
        return LLMEngine(config, model, params, tokenizer)
    return DataParallelEngine(config, model, params, tokenizer)


def device_groups(data_parallel_size: int, tensor_parallel_size: int) -> list[list]:
    """The devices of each replica: rows of a (data, model) grid over the first dp x tp."""
    import jax

    devices = jax.devices()
    need = data_parallel_size * tensor_parallel_size
    if need > len(devices):
        raise ValueError(f"data_parallel_size {data_parallel_size} x tensor_parallel_size "
                         f"{tensor_parallel_size} = {need} devices, but there are only "
                         f"{len(devices)}")
    return [devices[r * tensor_parallel_size:(r + 1) * tensor_parallel_size]
            for r in range(data_parallel_size)]


class DataParallelEngine:
    """LLMEngine's interface over `config.data_parallel_size` replicas."""

    def __init__(self, config: Any, model: Any, params: Any, tokenizer: Any = None) -> None:
        groups = device_groups(config.data_parallel_size, config.tensor_parallel_size)
        self.replicas = [LLMEngine(config, model, params, tokenizer, devices=devices)
                         for devices in groups]
        first = self.replicas[0]
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.max_model_len, self.vocab_size = first.max_model_len, first.vocab_size
        self._where: dict[str, LLMEngine] = {}  # request id -> its replica
        self._pending: list[RequestOutput] = []  # outputs of a step that also failed
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.replicas),
                                                           thread_name_prefix="jaxpage-dp")
        self._lock = threading.RLock()  # one caller at a time, as LLMEngine

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.replicas[0].tokenize(prompt)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: Any = None,
                    *, cache_salt: str | None = None, lora_request: Any = None) -> None:
        with self._lock:
            adapter = None if lora_request is None else getattr(lora_request, "cache_key", None)
            replica = self._route(request_id, prompt, cache_salt, adapter)
            replica.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                lora_request=lora_request)
            self._where[str(request_id)] = replica

    def add_beam_request(self, request_id: str, prompt: str | Sequence[int], params: Any) -> None:
        with self._lock:
            replica = self._route(request_id, prompt, None, None)
            replica.add_beam_request(request_id, prompt, params)
            self._where[str(request_id)] = replica

    def add_lora(self, lora_request: Any) -> bool:
        with self._lock:
            return [replica.add_lora(lora_request) for replica in self.replicas][0]

    def remove_lora(self, lora_int_id: int) -> bool:
        with self._lock:
            return [replica.remove_lora(lora_int_id) for replica in self.replicas][0]

    def list_loras(self) -> list:
        return self.replicas[0].list_loras()

    def _route(self, request_id: Any, prompt: Any, cache_salt: str | None,
               adapter: str | None) -> LLMEngine:
        """The replica with the longest cached prefix of the prompt, else the least loaded
        (a prompt that cannot be looked up goes to the least loaded, whose add_request then
        says what is wrong with it)."""
        if str(request_id) in self._where:
            raise ValueError(f"request_id {str(request_id)!r} is already in use")
        load = [len(r.requests) for r in self.replicas]
        best, best_hit = None, 0
        try:
            token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            for replica in self.replicas:
                hit = replica.allocator.lookup(token_ids, cache_salt=cache_salt,
                                               adapter_id=adapter).num_tokens
                if hit > best_hit:
                    best, best_hit = replica, hit
        except (ValueError, TypeError):
            pass
        if best is not None:
            return best
        return self.replicas[load.index(min(load))]

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            replica = self._where.get(str(request_id))
            if replica is not None:
                replica.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or any(r.has_unfinished_requests() for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        return all([r.reset_prefix_cache() for r in self.replicas])

    def warmup(self, shapes: int | None = None) -> tuple[int, float]:
        results = list(self._pool.map(lambda r: r.warmup(shapes), self.replicas))
        return sum(c for c, _ in results), max(s for _, s in results)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One step of every busy replica, concurrently. If one raises, the others' outputs
        are kept for the next step and the first error is raised (each replica is left as
        it was before its failed step, as LLMEngine.step promises)."""
        with self._lock:
            outputs, self._pending = self._pending, []
            busy = [r for r in self.replicas if r.has_unfinished_requests()]
            futures = [self._pool.submit(r.step) for r in busy]
            error = None
            for future in futures:
                try:
                    outputs += future.result()
                except Exception as exc:
                    error = error or exc
            for out in outputs:
                if out.finished:
                    self._where.pop(out.request_id, None)
            if error is not None:
                self._pending = outputs
                raise error
            return outputs

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Totals over the replicas (usage and latencies over all of them), and each
        replica's own stats under "replicas"."""
        per = [r.stats() for r in self.replicas]
        total = {key: sum(s[key] for s in per) for key in _SUMMED}
        total["kv_usage"] = total["kv_blocks_used"] / total["kv_blocks_total"]
        total["kv_peak_usage"] = max(s["kv_peak_usage"] for s in per)
        # the replicas step at once, each on its own thread: their phases add up to their
        # steps' seconds, as step_seconds does
        total["step_phases"] = {phase: sum(s["step_phases"][phase] for s in per)
                                for phase in per[0]["step_phases"]}
        metrics = [m for r in self.replicas for m in r.finished_metrics]
        total["ttft"] = _summary([m.ttft for m in metrics if m.ttft is not None])
        total["tpot"] = _summary([m.tpot for m in metrics if m.tpot is not None])
        total["replicas"] = per
        return total
