"""A request's host-side state as it moves through the scheduler (no JAX)."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from jaxpage.outputs import RequestMetrics
from jaxpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxpage.engine.speculative import Acceptance
    from jaxpage.lora import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # waiting, with its K/V in the host pool
    FINISHED = "finished"


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    `token_ids` is prompt + generated tokens; `num_computed_tokens` of them have their K/V
    in the pool (in the host pool while SWAPPED). A preempted request keeps its generated
    tokens and, unless it was swapped out, recomputes their K/V when readmitted.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling RNG seed (params.seed, or derived by the engine)
    metrics: RequestMetrics
    prompt: str | None = None
    cache_salt: str | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    sample_index: int = 0  # which of the request's n samples this sequence is
    group: RequestGroup | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # outputs accumulated by the engine
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    num_text_emitted: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # speculative decoding: this sequence's acceptance rate (jaxpage.engine.speculative)
    acceptance: Acceptance | None = None
    # structured outputs: the llguidance matcher that has read this sequence's output
    matcher: Any = None
    bad_words: list[tuple[int, ...]] | None = None  # `bad_words` as token ids
    # prompt_logprobs: None for the first prompt token, then one dict a prompt token scored
    # (shared by the request's samples: the prompt is theirs)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # the scheduler's records of this sequence's last plain decode (its ScheduledChunk and
    # SeqInput), which its next plain decode updates in place instead of making anew
    decode_records: tuple[Any, Any] | None = None
    # the allocator's key for this sequence, "<request_id>#<sample_index>" (set once: read
    # several times a step for every running sequence)
    seq_id: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        self.seq_id = f"{self.request_id}#{self.sample_index}"

    @property
    def num_slots(self) -> int:
        """Running slots this sequence will occupy: n for a parent whose samples (or beams)
        have not split off yet, else 1."""
        group = self.group
        return group.n if group is not None and not group.forked else 1

    @property
    def num_draws(self) -> int:
        """Tokens to draw from this sequence's next logits row: n for a parent whose n
        samples fork at the end of its prefill, else 1."""
        group = self.group
        return group.n if group is not None and group.forks_by_drawing else 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt tokens remain to be scored (prompt_logprobs): until then the
        prompt is computed, not taken from the prefix cache."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def max_num_tokens(self) -> int:
        """Tokens the request can reach: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclasses.dataclass(slots=True, eq=False)
class RequestGroup:
    """A user request: its n samples. The prompt is prefilled once, by sample 0; at the end
    of that prefill the other samples fork from it and share its blocks."""

    request_id: str
    n: int
    samples: list[Request]
    forked: bool = False
    error: str | None = None  # set when a failure in a step ended the request

    @property
    def finished(self) -> bool:
        samples = self.samples  # before forking: just the parent
        if len(samples) == 1:
            return samples[0].status is RequestStatus.FINISHED
        return all(s.status is RequestStatus.FINISHED for s in samples)

    @property
    def forks_by_drawing(self) -> bool:
        """Whether the next draw of the parent yields all n samples' first tokens."""
        return not self.forked
