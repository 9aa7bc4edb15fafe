"""Beam search over the engine's sequences (host side, no JAX).

Each live beam is a sequence in the scheduler and allocator. When every live beam of a
request has its next-token log-probabilities (the top `2 * beam_width` of each, from the
sampler), `rank_beams` ranks the candidates exactly as HF transformers' `_beam_search` does
(top-k over all beams' accumulated log-probs, finished hypotheses scored with the length
penalty, the same early-stopping heuristic) and returns a `BeamPlan`: which beams continue
with which token, which fork into several children, which end. It is a pure function of
its arguments; the scheduler applies the plan (a child forks its parent's blocks, a beam
with no child is freed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpage.engine.request import Request, RequestGroup
from jaxpage.sampling_params import BeamSearchParams

_NEG = -1.0e9  # HF's "impossible" score


@dataclasses.dataclass(frozen=True, slots=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens (with the final EOS, if it ended on one)
    score: float  # cumulative log-prob / generated_len ** length_penalty
    cumulative_logprob: float


@dataclasses.dataclass(frozen=True, slots=True)
class LiveBeam:
    """What ranking needs of one live beam: its accumulated score, its generated tokens and
    the top log-probabilities of its next token {token id: log-prob}."""

    score: float
    output_token_ids: Sequence[int]
    top_logprobs: dict[int, float]


@dataclasses.dataclass(frozen=True, slots=True)
class NextBeam:
    """A beam of the next step: live beam `parent` extended by `token`. The first child of a
    parent continues its sequence; each further child (`fork`) copies it first."""

    parent: int
    token: int
    logprob: float
    score: float
    fork: bool


@dataclasses.dataclass(frozen=True, slots=True)
class BeamPlan:
    """One step of beam search. `next_beams` are the next live beams, best first (ties in
    HF's order); live beams named by none of them end. When `done`, every beam ends and the
    result is `finished_hyps`."""

    next_beams: list[NextBeam]
    finished_hyps: list[Hypothesis]  # best first, at most beam_width
    improvable: bool  # HF's is_early_stop_heuristic_unsatisfied
    done: bool


def num_candidates(params: BeamSearchParams, eos_token_ids: Sequence[int]) -> int:
    """HF's beams_to_keep: enough candidates that W survive even if some hit EOS."""
    num_eos = 0 if params.ignore_eos else len(eos_token_ids)
    return max(2, 1 + num_eos) * params.beam_width


def rank_beams(params: BeamSearchParams, eos_token_ids: Sequence[int], *, prompt_len: int,
               beams: Sequence[LiveBeam], finished_hyps: Sequence[Hypothesis],
               improvable: bool) -> BeamPlan:
    """Rank this step's candidates of all live `beams` (all of one length) as HF does."""
    width, lp = params.beam_width, params.length_penalty
    cur_len = prompt_len + len(beams[0].output_token_ids)
    max_len = prompt_len + params.max_tokens
    candidates = []  # (accumulated log-prob, beam index, token, token log-prob)
    for b, beam in enumerate(beams):
        for token, logprob in beam.top_logprobs.items():
            candidates.append((beam.score + logprob, b, token, logprob))
    # torch.topk over the flattened [beams * vocab] scores: best first; ties by index
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    # one beam is greedy decoding (as HF runs num_beams=1): the best token, stop at EOS
    candidates = candidates[: 1 if width == 1 else num_candidates(params, eos_token_ids)]
    hits = [c[2] in eos or cur_len + 1 >= max_len for c in candidates]

    # finished hypotheses: only the top `width` candidates may finish
    finished = list(finished_hyps)
    all_full = len(finished) >= width and params.early_stopping is True
    for rank, (cand, hit) in enumerate(zip(candidates, hits, strict=True)):
        if rank < width and hit and improvable and not all_full:
            accumulated, b, token, _ = cand
            finished.append(Hypothesis(list(beams[b].output_token_ids) + [token],
                                       accumulated / ((cur_len + 1 - prompt_len) ** lp),
                                       accumulated))
    finished.sort(key=lambda h: -h.score)
    del finished[width:]

    # next live beams: the best `width` candidates, finished ones pushed last
    ranked = sorted(range(len(candidates)),
                    key=lambda i: -(candidates[i][0] + (_NEG if hits[i] else 0.0)))[:width]
    next_scores = [candidates[i][0] + (_NEG if hits[i] else 0.0) for i in ranked]
    keep_going = not all(hits)
    next_beams = _next_beams(len(beams), [candidates[i] for i in ranked], next_scores)

    # HF's early-stopping heuristic, on the best running beam
    cur_len += 1
    if params.early_stopping == "never" and lp > 0:
        best_len = max_len - prompt_len
    else:
        best_len = cur_len - prompt_len
    best_running = next_scores[0] / (best_len ** lp)
    full = len(finished) >= width
    worst_finished = min(h.score for h in finished) if full else _NEG
    improvable = improvable and best_running > worst_finished
    done = not keep_going or not improvable or (full and params.early_stopping is True)
    return BeamPlan([] if done else next_beams, finished, improvable, done)


def _next_beams(num_beams: int, chosen, scores: list[float]) -> list[NextBeam]:
    """Children of each live beam, in HF's order: by parent, the first child continuing the
    parent's sequence; then best first (a stable sort, so equal scores keep that order)."""
    children: dict[int, list[tuple[int, float, float]]] = {}
    for (_, b, token, logprob), score in zip(chosen, scores, strict=True):
        children.setdefault(b, []).append((token, logprob, score))
    beams = []
    for b in range(num_beams):
        kids = children.get(b, [])
        beams += [NextBeam(b, token, logprob, score, True) for token, logprob, score in kids[1:]]
        beams += [NextBeam(b, token, logprob, score, False) for token, logprob, score in kids[:1]]
    return sorted(beams, key=lambda beam: -beam.score)


@dataclasses.dataclass(slots=True, eq=False)
class BeamGroup(RequestGroup):
    """A beam-search request's state: `samples` are its live beams, best first."""

    beam: BeamSearchParams = dataclasses.field(default_factory=BeamSearchParams)
    eos_token_ids: tuple[int, ...] = ()
    scores: dict[int, float] = dataclasses.field(default_factory=dict)  # id(beam) -> score
    pending: dict[Request, object] = dataclasses.field(default_factory=dict)  # this step's draws
    finished_hyps: list[Hypothesis] = dataclasses.field(default_factory=list)
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False
    next_index: int = 0  # sample_index of the newest beam

    @property
    def finished(self) -> bool:
        return self.done

    @property
    def num_candidates(self) -> int:
        return num_candidates(self.beam, self.eos_token_ids)

    @property
    def forks_by_drawing(self) -> bool:
        return False  # beams split by their plans, from each beam's top log-probs

    def ready(self) -> bool:
        """Whether every live beam has drawn its next token's log-probabilities."""
        return len(self.pending) == len(self.samples)

    def plan(self) -> BeamPlan:
        """Rank this step's candidates (every live beam has drawn)."""
        beams = [LiveBeam(self.scores[id(beam)], beam.output_token_ids,
                          self.pending[beam].top_logprobs) for beam in self.samples]
        return rank_beams(self.beam, self.eos_token_ids,
                          prompt_len=self.samples[0].num_prompt_tokens, beams=beams,
                          finished_hyps=self.finished_hyps, improvable=self.improvable)

    def best(self) -> list[Hypothesis]:
        return self.finished_hyps[: self.beam.beam_width]
