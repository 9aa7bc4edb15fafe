"""Speculative decoding's host side: its config, the proposers, per-request draft length and
the acceptance statistics (plain Python and NumPy, no JAX).

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

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxpage.validation import check, is_int

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`, as a dict or this class.

    method "ngram" (prompt lookup): the longest n-gram (`prompt_lookup_min` to
    `prompt_lookup_max` tokens) ending the sequence that occurred earlier in it (prompt and
    output) proposes the tokens that followed its latest earlier occurrence.
    num_speculative_tokens: k, the most drafts per sequence and step (1 to 16).
    adaptive: a request's k follows its acceptance (see `DraftLength`); off, every step
    proposes up to k.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive: bool = True

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


class DraftLength:
    """A request's draft length: starts at k; after a verification it grows by one when
    every draft was accepted and shrinks by one when none was, down to 0, where the request
    decodes without drafts and tries one draft again after `retry_after` steps. So a request
    whose text the proposer cannot guess (open-ended chat for prompt lookup) soon runs as
    without speculation, and one that quotes its prompt speculates at full length."""

    __slots__ = ("k", "idle")
    retry_after = 16

    def __init__(self, k: int) -> None:
        self.k, self.idle = k, 0

    def current(self) -> int:
        if self.k == 0:
            self.idle += 1
            if self.idle < self.retry_after:
                return 0
            self.idle, self.k = 0, 1
        return self.k

    def observe(self, num_drafts: int, num_accepted: int, k_max: int) -> None:
        if num_accepted == num_drafts:
            self.k = min(self.k + 1, k_max)
        elif num_accepted == 0:
            self.k -= 1


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

    def summary(self) -> dict[str, Any]:
        """The counts, the acceptance rate (accepted / proposed), the mean acceptance length
        (tokens a verification emits: accepted + the target's own, vLLM's definition) and
        each position's acceptance rate."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                if self.num_draft_tokens else 0.0),
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
