"""Prometheus metrics under vLLM's names (existing vLLM dashboards work), plus jaxpage's own.

Engine state (requests running and waiting, KV usage, prefix-cache and preemption totals,
compilations) is read from `LLMEngine.stats()` when scraped; per-request counters and
latency histograms are observed from each finished request's output on the engine thread.
Every server has its own registry, so several can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpage.outputs import RequestOutput

prometheus_client.disable_created_metrics()  # as vLLM: no `_created` series per counter

# vLLM's buckets (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's Prometheus registry; `observe(output)` for every engine output."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, names + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, buckets=buckets,
                             registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = counter("vllm:request_success", "Requests finished, by reason.",
                                       ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time to first token (arrival at the engine to first token).",
                              _TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Request latency (arrival at the engine to finish).", _E2E_BUCKETS)
        self.registry.register(_EngineCollector(stats, labels))

    def observe(self, out: RequestOutput) -> None:
        """Count one engine output: tokens of its deltas; at its end, the request."""
        labels = self._labels
        generated = sum(len(c.token_ids) for c in out.outputs)
        if generated:
            self.generation_tokens.labels(**labels).inc(generated)
        if not out.finished:
            return
        self.prompt_tokens.labels(**labels).inc(len(out.prompt_token_ids))
        for completion in out.outputs:
            reason = completion.finish_reason or "abort"
            self.request_success.labels(**labels, finished_reason=reason).inc()
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# (kind, name, help, LLMEngine.stats() key) of what is read at scrape time
_ENGINE_METRICS = (
    (GaugeMetricFamily, "vllm:num_requests_running",
     "Sequences running (a request's n samples count n).", "num_running"),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Sequences waiting (new or preempted).",
     "num_waiting"),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
     "kv_usage"),
    (CounterMetricFamily, "vllm:prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     "prefix_cache_hits"),
    (CounterMetricFamily, "vllm:num_preemptions", "Preemptions of running sequences.",
     "num_preemptions"),
    (GaugeMetricFamily, "jaxpage:compiles", "Step shapes compiled so far.", "compiles"),
    (GaugeMetricFamily, "jaxpage:compile_seconds", "Seconds spent compiling step shapes.",
     "compile_seconds"),
)


class _EngineCollector:
    """Gauges and totals read from the engine's stats at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self):
        stats = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        for kind, name, doc, key in _ENGINE_METRICS:
            metric = kind(name, doc, labels=names)
            metric.add_metric(values, stats[key])
            yield metric
        spec = stats.get("spec_decode")
        if spec is None:  # speculative decoding off
            return
        for name, doc, key in _SPEC_METRICS:
            metric = CounterMetricFamily(name, doc, labels=names)
            metric.add_metric(values, spec[key])
            yield metric
        metric = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position (0: first).",
                                     labels=[*names, "position"])
        for position, accepted in enumerate(spec["accepted_per_pos"]):
            metric.add_metric([*values, str(position)], accepted)
        yield metric


# speculative decoding's totals (jaxpage.engine.speculative.SpecStats), vLLM's names
_SPEC_METRICS = (
    ("vllm:spec_decode_num_drafts", "Proposals verified (one sequence's drafts in a step).",
     "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
)
