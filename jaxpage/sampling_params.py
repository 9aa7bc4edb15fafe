"""Per-request generation parameters, validated where they enter (vLLM's names and ranges)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

from jaxpage.structured import StructuredOutputsParams
from jaxpage.validation import check, is_int, is_real, is_vector

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value, [-100, 100]
INT32_MAX = 2**31 - 1  # per-row parameters are packed as int32


class RequestOutputKind(enum.IntEnum):
    """What a request's outputs from `LLMEngine.step` carry (vLLM's names and values).

    DELTA: after each step that changed a sample, that sample's new tokens and text (the
    engine's default: a stream). CUMULATIVE: after each such step, every sample's tokens and
    text so far. FINAL_ONLY: one output, when the request ends, with everything; until then
    the engine builds no outputs for it, and detokenizes it only if it has stop strings
    (`LLM.generate` asks for this: it keeps only the end).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuations.

    temperature=0 is greedy. A `seed` makes sampling reproducible whatever else is in the
    batch; without one, the engine derives a seed from its own seed and the request.
    `top_k` of -1 (or 0) disables top-k. Penalties follow vLLM: presence/frequency are
    subtracted from the logits of generated tokens; repetition divides positive and
    multiplies negative logits of prompt and generated tokens.

    Also vLLM's: `structured_outputs` constrains the output to a JSON schema, regex, choice
    or grammar (`jaxpage.structured`); `output_kind` says whether `LLMEngine.step` streams
    deltas (the default here; vLLM's default is CUMULATIVE), the state so far, or only the
    end (`RequestOutputKind`); `logit_bias` adds a value in [-100, 100] to a token's
    logit before the penalties; `allowed_token_ids` restricts every draw to those tokens and
    `bad_words` bans each word's last token wherever the output ends with the rest of it;
    `prompt_logprobs` reports, for every prompt token after the first, its log-probability
    and the top ones at its position. Log-probabilities are the model's, before any of
    these (but a constraint's mask, as vLLM applies it to the logits first).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = dataclasses.field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self) -> None:
        # Accept lists and a single stop string for convenience; store tuples (hashable).
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop)
        check(stop is not None, "stop", self.stop, "a string or a list of strings")
        object.__setattr__(self, "stop", stop)
        stop_token_ids = _as_tuple(self.stop_token_ids)
        check(stop_token_ids is not None, "stop_token_ids", self.stop_token_ids,
              "a list of integers")
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        check(is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        check(is_real(self.temperature) and math.isfinite(self.temperature)
              and self.temperature >= 0, "temperature", self.temperature, "finite and >= 0")
        check(is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        check(is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX, "top_k", self.top_k,
              f"an integer in [-1, {INT32_MAX}] (-1 or 0 disables)")
        check(is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        check(self.seed is None or is_int(self.seed), "seed", self.seed, "an integer or None")
        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
              "an integer >= 1")
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
              "min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        for s in self.stop:
            check(isinstance(s, str) and s != "", "stop", s, "non-empty strings")
        for t in self.stop_token_ids:
            check(is_int(t) and t >= 0, "stop_token_ids", t, "integers >= 0")
        check(self.logprobs is None or (is_int(self.logprobs)
                                        and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(is_real(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        check(is_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
              and self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
              "finite and > 0")
        self._check_token_controls()
        check(is_int(self.output_kind) and self.output_kind in tuple(RequestOutputKind),
              "output_kind", self.output_kind,
              "a RequestOutputKind (0 CUMULATIVE, 1 DELTA, 2 FINAL_ONLY)")
        object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        # numpy scalars are accepted; store plain Python numbers
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                     "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def _check_token_controls(self) -> None:
        """The checks of the fields that constrain or bias tokens (token ids against the
        vocabulary: the engine's, `LLMEngine.add_request`)."""
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
                  "a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                check(is_int(token) and token >= 0, "logit_bias", token,
                      "keyed by token ids (integers >= 0)")
                check(is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                      f"logit_bias[{token}]", bias,
                      f"in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            object.__setattr__(self, "logit_bias", {
                int(t): float(b) for t, b in self.logit_bias.items()} or None)
        if self.allowed_token_ids is not None:
            allowed = _as_tuple(self.allowed_token_ids)
            check(bool(allowed) and all(is_int(t) and t >= 0 for t in allowed),
                  "allowed_token_ids", self.allowed_token_ids,
                  "a non-empty list of token ids (integers >= 0)")
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in allowed))
        if self.bad_words is not None:
            words = _as_tuple(self.bad_words)
            check(words is not None and all(isinstance(w, str) and w.strip() for w in words),
                  "bad_words", self.bad_words, "a list of non-blank strings")
            object.__setattr__(self, "bad_words", words or None)
        check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs)
                                               and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
              "prompt_logprobs", self.prompt_logprobs,
              f"None or an integer in [0, {MAX_LOGPROBS}]")

    # read for every sequence every step: worked out once (the params are frozen; a cached
    # property keeps its value in the instance's dict, past the frozen __setattr__)
    @functools.cached_property
    def uses_history(self) -> bool:
        """Whether a draw depends on the tokens drawn before it: penalties, bad words, a
        constraint."""
        return self.uses_penalties or self.history_on_host

    @functools.cached_property
    def history_on_host(self) -> bool:
        """Whether a draw needs the tokens drawn before it on the host (so that no step may
        run ahead of the one that draws its last token): bad words (the bans they make) and
        a constraint's matcher. Penalties count the tokens on the device: a step run ahead
        adds the one its predecessor drew there."""
        return self.bad_words is not None or self.structured_outputs is not None

    @functools.cached_property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @functools.cached_property
    def uses_filters(self) -> bool:
        """Whether a draw masks tokens (top-k, top-p or min-p; greedy draws never do)."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0 or self.min_p > 0)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """Beam search: the `beam_width` best hypotheses ranked with HF's length penalty."""

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | str = False  # HF's: True, False (heuristic) or "never"

    def __post_init__(self) -> None:
        check(is_int(self.beam_width) and self.beam_width >= 1, "beam_width",
              self.beam_width, "an integer >= 1")
        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
              self.max_tokens, "an integer >= 1")
        check(is_real(self.length_penalty) and math.isfinite(self.length_penalty),
              "length_penalty", self.length_penalty, "a finite number")
        check(self.early_stopping in (True, False, "never"), "early_stopping",
              self.early_stopping, 'True, False or "never"')


@dataclasses.dataclass(slots=True)
class SamplingRow:
    """One token draw of one sequence in a step (host side): the request's parameters, the
    draw's RNG counter (seed, step = output position), and the token ids the penalties and
    bans need. `sampling.SamplingMetadata.pack` turns a step's rows into device arrays.
    Read-only by convention, not frozen: the scheduler makes one for every sequence every
    step, and a frozen dataclass takes 4x as long to make (1.4 us against 0.3)."""

    params: SamplingParams
    seed: int
    step: int
    prompt_token_ids: Sequence[int] | None = None  # only with penalties
    output_token_ids: Sequence[int] | None = None
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS and stop tokens before min_tokens
    matcher: Any = None  # a structured output's llguidance matcher
    drafted: tuple[int, ...] = ()  # the drafts this draw follows (the matcher has not read)
    forced_token: int = -1  # prompt log-probabilities: the token "drawn" (-1: none)

    @property
    def num_logprobs(self) -> int:
        """Top log-probabilities to report (at least 1 when any are asked for)."""
        return 0 if self.params.logprobs is None else max(self.params.logprobs, 1)


def _as_tuple(value) -> tuple | None:
    """A list-like value (None: empty) as a tuple; None for anything else (a number, a
    mapping, a set, ...)."""
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(value)
    if is_vector(value):
        return tuple(value.tolist())
    return None


def sample_seed(seed: int, index: int) -> int:
    """The RNG seed of sample `index` of a request seeded with `seed` (n > 1): sample 0 uses
    the request's seed, the others a 32-bit hash of (seed, index). A single-sample request
    run with this seed reproduces that sample."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"jaxpage-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
