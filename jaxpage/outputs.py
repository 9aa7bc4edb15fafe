"""What the engine returns: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One continuation of a request.

    token_ids: generated tokens only. logprobs: per generated token a dict
    {token_id: logprob} holding the top-`logprobs` tokens plus the sampled one, or None
    when not requested. finish_reason: None while running, else "stop", "length" or
    "abort"; stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # at the end: the longest sample's (beam's) output tokens

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None until it has finished with
        two tokens or more)."""
        if (self.finished_time is None or self.first_token_time is None
                or self.num_output_tokens < 2):
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    """A request's state as of one engine step (streaming: `outputs[i].text` is the delta
    when the engine was asked for deltas; otherwise the full text so far)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # why the engine ended the request itself (a failure in one of its steps; its
    # completions then end with finish_reason "abort"); None otherwise
    error: str | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then for each prompt
    # token {its id: its log-prob, and the top ones at its position}; in every output once
    # the prompt is computed (None before, and without prompt_logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None
