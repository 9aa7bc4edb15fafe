"""Speculative decoding's host side: its config, the n-gram proposer, when drafts pay (each
request's acceptance, the fitted step cost) and the acceptance statistics (plain Python and
NumPy, no JAX).

A running sequence that decodes asks its proposer for up to k draft tokens; the step runs
the sequence's last token and its drafts through the target model as one chunk of the
ragged batch and draws a token at each of those k + 1 positions with the sampler exactly as
a step without speculation would draw it there (the same parameters, the same output
position as the draw's RNG counter). The scheduler then accepts the drafts while each equals
the target's draw at its position and emits the target's draw where the first one differs
(or the bonus draw after the last). See docs/architecture.md, "Speculative decoding", for
why this is Leviathan et al.'s rejection sampling for proposers whose q is one-hot (every
proposer here proposes a single token per position), and why it makes a request's tokens
with speculation those without it, seeded or greedy.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxpage.validation import check, is_int

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# a draft token the runner's draft model is yet to propose (SeqInput.token_ids)
DRAFT_SLOT = -1


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`, as a dict or this class.

    method "ngram" (prompt lookup): the longest n-gram (`prompt_lookup_min` to
    `prompt_lookup_max` tokens) ending the sequence that occurred earlier in it (prompt and
    output) proposes the tokens that followed its latest earlier occurrence.
    method "draft_model": a smaller model proposes k tokens greedily, one draft step after
    another, before the step verifies them. `model` is what `LLM(model=...)` loads (an HF
    directory, a .gguf file, a jaxpage checkpoint) with the target's vocabulary: it keeps
    its own K/V in a pool of its own, at the block ids of the target's tables, for every
    token the target computes (so prefix hits, forks, preemption and swap cover it). Or
    `model` "self": the target cut to its first `draft_layers` layers (then its final norm
    and LM head: LayerSkip's early exit, no second checkpoint), whose K/V of those layers is
    the target's own for the same tokens, so it reads and writes the target's pool (the
    verification rewrites the draft slots with the same values).
    num_speculative_tokens: k, the most drafts per sequence and step (1 to 16).
    adaptive: each request proposes only the drafts worth their cost, from its acceptance
    rate so far and what a step costs on this machine (`Acceptance`, `StepCost`); off,
    every step proposes up to k.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive: bool = True
    model: str | None = None
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        check(self.method in METHODS, "speculative_config.method", self.method,
              f"one of {METHODS}")
        k = self.num_speculative_tokens
        check(is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
              "speculative_config.num_speculative_tokens", k,
              f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        check(is_int(low) and low >= 1, "speculative_config.prompt_lookup_min", low,
              "an integer >= 1")
        check(is_int(high) and high >= low, "speculative_config.prompt_lookup_max", high,
              f"an integer >= prompt_lookup_min ({low})")
        check(isinstance(self.adaptive, bool), "speculative_config.adaptive", self.adaptive,
              "True or False")
        if self.method == "ngram":
            check(self.model is None, "speculative_config.model", self.model,
                  "None with method 'ngram'")
            check(self.draft_layers is None, "speculative_config.draft_layers",
                  self.draft_layers, "None with method 'ngram'")
            return
        check(isinstance(self.model, str) and self.model, "speculative_config.model",
              self.model, "the draft's model (a path or name) or 'self' with method "
              "'draft_model'")
        if self.model == "self":
            check(is_int(self.draft_layers) and self.draft_layers >= 1,
                  "speculative_config.draft_layers", self.draft_layers, "an integer >= 1")
        else:
            check(self.draft_layers is None, "speculative_config.draft_layers",
                  self.draft_layers, "None unless model is 'self'")

    @property
    def draft_checkpoint(self) -> str | None:
        """The draft model to load (method "draft_model", `model` not "self"), else None."""
        return self.model if self.method == "draft_model" and self.model != "self" else None

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a dict (vLLM's spelling), a SpeculativeConfig or None; ValueError
        naming an unknown or bad field."""
        if value is None or isinstance(value, cls):
            return value
        check(isinstance(value, Mapping), "speculative_config", value,
              "a dict such as {\"method\": \"ngram\", \"num_speculative_tokens\": 3}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        check(not unknown, "speculative_config", dict(value),
              f"a dict of the fields {sorted(fields)} (unknown: {unknown})")
        check("method" in value, "speculative_config", dict(value), "a dict with a 'method'")
        return cls(**value)


class NgramProposer:
    """Prompt lookup: the drafts for a sequence are the tokens that followed the latest
    earlier occurrence of its longest matching suffix n-gram (`lookup_min` <= n <=
    `lookup_max`); none when even its last `lookup_min` tokens never occurred before.

    One pass of vectorized comparisons over the sequence for the shortest n-gram's
    candidates, then a few comparisons per candidate to extend each match backwards: no
    Python loop over the tokens."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        n_min = self.lookup_min
        tokens = np.asarray(token_ids)
        length = tokens.shape[0]
        if k < 1 or length <= n_min:
            return []
        suffix = tokens[length - n_min:]
        # candidates: starts i < length - n_min with tokens[i:i + n_min] == suffix (the
        # suffix itself excluded, so at least one token follows every candidate)
        hit = tokens[: length - n_min] == suffix[0]
        for j in range(1, n_min):
            hit &= tokens[j : length - n_min + j] == suffix[j]
        starts = np.flatnonzero(hit)
        if starts.size == 0:
            return []
        # extend each candidate's match backwards, up to lookup_max tokens in all
        matched = np.full(starts.shape, n_min)
        alive = np.ones(starts.shape, bool)
        for extra in range(1, self.lookup_max - n_min + 1):
            before = starts - extra
            alive &= before >= 0
            alive[alive] &= tokens[before[alive]] == tokens[length - n_min - extra]
            if not alive.any():
                break
            matched += alive
        # the longest match; of those, the latest
        best = starts[np.flatnonzero(matched == matched.max())[-1]]
        follow = best + n_min
        return tokens[follow : follow + k].tolist()


class Acceptance:
    """A request's record as a speculator. Its acceptance rate is the fraction of its draft
    positions the target confirmed (a verification of d drafts that accepted m is m
    successes in m + 1 trials, or in m if all d were accepted), its yield the drafts it got
    accepted per step it tried to speculate (a step whose proposer found nothing yields 0);
    older steps weigh less (each scales them by `decay`), over a prior of one trial at the
    engine's rate so far.

    A request whose drafts are not worth proposing (its rate too low for the step's
    threshold), or whose yield no longer pays for what a step with drafts costs, rests: it
    proposes nothing, so that its decode steps may run ahead again (open-ended text, where
    prompt lookup rarely finds anything), until the engine step after next whose number is
    a multiple of `rest_steps` (17 to 32 steps on), then tries at least one draft again (so
    a text that turns predictable, or a low prior, is found out). Resting requests all try
    again at the same step: a step runs ahead only when none of its sequences may draft
    next, so four requests trying at steps of their own would stop it four times as often
    (open-ended prompts at a batch of 4: 0.90x the TPOT without speculation, all of it
    lost running ahead)."""

    __slots__ = ("hits", "trials", "yield_", "resume", "rested")
    decay = 0.75
    rest_steps = 16

    def __init__(self) -> None:
        self.hits = self.trials = 0.0
        self.yield_ = 1.0  # optimistic: a new request gets a few steps to show its yield
        self.resume = 0  # the first step it may propose in again
        self.rested = False

    def _rest_from(self, step: int) -> None:
        self.resume = (step // self.rest_steps + 2) * self.rest_steps
        self.rested = True

    def rate(self, prior: float) -> float:
        return (self.hits + prior) / (self.trials + 1.0)

    def length(self, room: int, threshold: float, prior: float, step: int) -> int:
        """Drafts worth proposing in engine step `step`, at most `room`: none while resting,
        else the positions i whose chance of acceptance rate**i beats `threshold`
        (`StepCost.threshold`), at least one right after a rest; none worth it starts a
        rest."""
        if self.waits(step):
            return 0
        k = drafts_worth(self.rate(prior), threshold, room)
        if self.rested:
            self.rested = False
            return max(k, min(1, room))
        if not k:
            self._rest_from(step)
        return k

    def observe(self, num_drafts: int, num_accepted: int, saving: float,
                switch: float, step: int) -> None:
        """Engine step `step`, in which it tried to speculate: `num_drafts` proposed (0: the
        proposer found nothing), `num_accepted` of them accepted; rests when its yield, each
        accepted draft saving `saving` seconds, no longer beats `switch`
        (`StepCost.terms`)."""
        if num_drafts:
            self.hits = self.hits * self.decay + num_accepted
            self.trials = (self.trials * self.decay + num_accepted
                           + (num_accepted < num_drafts))
        self.yield_ = self.yield_ * self.decay + num_accepted * (1 - self.decay)
        if self.yield_ * saving < switch:
            self._rest_from(step)
            self.yield_ = switch / saving  # its next try starts at the margin

    def waits(self, step: int) -> bool:
        """Whether it surely proposes nothing in engine step `step` (so the step before
        may run ahead of it)."""
        return step < self.resume


def drafts_worth(rate: float, threshold: float, room: int) -> int:
    """How many leading draft positions i (1, 2, ...) have rate**i > threshold, at most
    `room`: the i-th draft is accepted only if every one before it is."""
    k, chance = 0, rate
    while k < room and chance > threshold:
        k += 1
        chance *= rate
    return k


def expected_gain(rate: float, num_drafts: int, saving: float, draft_cost: float) -> float:
    """Device seconds a proposal of `num_drafts` saves in expectation: each accepted draft
    is a later step's row not run (`saving`), each draft a row run now (`draft_cost`)."""
    gain, chance = 0.0, rate
    for _ in range(num_drafts):
        gain += chance * saving - draft_cost
        chance *= rate
    return gain


class StepCost:
    """What a step costs on this machine, fitted as it runs: a step without prompt chunks
    takes a + b * tokens seconds, plus c when it carries drafts (their tokens run the
    prefill path; on a CPU the decode step's own path and running ahead are lost). Least
    squares over the last `window` such steps that compiled nothing, refitted every 16;
    until it has seen 8 steps with drafts and 8 without, a rough prior (b = a / 16, c = a /
    8). The fit for SmolLM2 bfloat16 on a 2-core Xeon at batch 1: a 11.7 ms, b 1.8 ms,
    c 0.8 ms.

    At a batch of B sequences an accepted draft saves a later step's row, a / B + b, and
    every draft costs b now: a draft at position i is worth proposing while its chance of
    acceptance beats the threshold b / (a / B + b), and a step carries drafts only when
    their expected saving beats c."""

    def __init__(self, window: int = 256) -> None:
        self.samples: collections.deque[tuple[int, bool, float]] = collections.deque(
            maxlen=window)
        self.coefficients = (1.0, 1 / 16, 1 / 8)  # (a, b, c)
        self._new = 0

    def observe(self, num_tokens: int, drafts: bool, seconds: float) -> None:
        self.samples.append((num_tokens, drafts, seconds))
        self._new += 1
        if self._new >= 16:
            self._new = 0
            self._fit()

    def _fit(self) -> None:
        data = np.array(self.samples, np.float64)
        with_drafts = int(data[:, 1].sum())
        if min(with_drafts, len(data) - with_drafts) < 8 or np.ptp(data[:, 0]) == 0:
            return
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        (a, b, c), *_ = np.linalg.lstsq(x, data[:, 2], rcond=None)
        if a > 0:
            self.coefficients = (float(a), max(float(b), 0.0), max(float(c), 0.0))

    def terms(self, batch: int) -> tuple[float, float, float]:
        """(saving of an accepted draft, cost of a draft, cost of carrying drafts at all)
        at a batch of `batch` sequences."""
        a, b, c = self.coefficients
        return a / max(batch, 1) + b, b, c

    def threshold(self, batch: int) -> float:
        saving, draft_cost, _ = self.terms(batch)
        return draft_cost / saving


@dataclasses.dataclass
class SpecStats:
    """Acceptance counts since the engine started, with vLLM's meanings: a draft is one
    sequence's proposal verified in a step (at least one token); draft tokens, the tokens
    proposed; accepted, those accepted; per position, the accepted tokens at each draft
    position (position 0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    drafts_per_pos: list[int] = dataclasses.field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.drafts_per_pos)
        if grow > 0:
            self.drafts_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for pos in range(num_drafts):
            self.drafts_per_pos[pos] += 1
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def acceptance_rate(self, default: float) -> float:
        """Accepted over proposed draft tokens so far (`default` before any)."""
        if not self.num_draft_tokens:
            return default
        return self.num_accepted_tokens / self.num_draft_tokens

    def summary(self) -> dict[str, Any]:
        """The counts, the acceptance rate (accepted / proposed), the mean acceptance length
        (tokens a verification emits: accepted + the target's own, vLLM's definition) and
        each position's acceptance rate."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate(default=0.0),
            "mean_acceptance_length": (1 + self.num_accepted_tokens / self.num_drafts
                                       if self.num_drafts else 0.0),
            "acceptance_rate_per_pos": [a / d if d else 0.0 for a, d in zip(
                self.accepted_per_pos, self.drafts_per_pos, strict=True)],
        }


def num_accepted(drafts: Sequence[int], draws: Sequence[int]) -> int:
    """How many leading drafts equal the target's draws at their positions."""
    n = 0
    for draft, drawn in zip(drafts, draws, strict=False):
        if draft != drawn:
            break
        n += 1
    return n
