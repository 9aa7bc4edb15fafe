"""Beam search over the engine's sequences (host side, no JAX).

Each live beam is a sequence in the scheduler and allocator. When every live beam of a
request has its next-token log-probabilities (the top `2 * beam_width` of each, from the
sampler), `BeamGroup.advance` ranks the candidates exactly as HF transformers'
`_beam_search` does (top-k over all beams' accumulated log-probs, finished hypotheses
scored with the length penalty, the same early-stopping heuristic), then reshapes the
beams: a beam that survives into several children forks (the children share all its
blocks), a beam with no child is freed.
"""

from __future__ import annotations

import dataclasses

from jaxpage.engine.request import Request, RequestGroup
from jaxpage.sampling_params import BeamSearchParams

_NEG = -1.0e9  # HF's "impossible" score


@dataclasses.dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens (with the final EOS, if it ended on one)
    score: float  # cumulative log-prob / generated_len ** length_penalty
    cumulative_logprob: float


@dataclasses.dataclass(slots=True, eq=False)
class BeamGroup(RequestGroup):
    """A beam-search request: `samples` are its live beams, best first."""

    beam: BeamSearchParams = dataclasses.field(default_factory=BeamSearchParams)
    eos_token_ids: tuple[int, ...] = ()
    scores: dict[int, float] = dataclasses.field(default_factory=dict)  # id(beam) -> score
    pending: dict[Request, object] = dataclasses.field(default_factory=dict)
    finished_hyps: list[Hypothesis] = dataclasses.field(default_factory=list)
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False
    next_index: int = 0  # sample_index of the newest beam

    @property
    def finished(self) -> bool:
        return self.done

    @property
    def num_candidates(self) -> int:
        """HF's beams_to_keep: enough candidates that W survive even if some hit EOS."""
        num_eos = 0 if self.beam.ignore_eos else len(self.eos_token_ids)
        return max(2, 1 + num_eos) * self.beam.beam_width

    @property
    def forks_by_drawing(self) -> bool:
        return False  # beams split in advance(), from each beam's top log-probs

    def ready(self) -> bool:
        return len(self.pending) == len(self.samples)

    def advance(self, scheduler) -> None:
        """Rank this step's candidates, record finished hypotheses, reshape the beams."""
        width, lp = self.beam.beam_width, self.beam.length_penalty
        beams = list(self.samples)
        prompt_len = beams[0].num_prompt_tokens
        cur_len = beams[0].num_tokens  # all live beams have the same length
        max_len = prompt_len + self.beam.max_tokens
        candidates = []  # (accumulated log-prob, beam index, token, token log-prob)
        for b, beam in enumerate(beams):
            draw = self.pending[beam]
            for token, logprob in draw.top_logprobs.items():
                candidates.append((self.scores[id(beam)] + logprob, b, token, logprob))
        # torch.topk over the flattened [beams * vocab] scores: best first; ties by index
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        eos = () if self.beam.ignore_eos else self.eos_token_ids
        # one beam is greedy decoding (as HF runs num_beams=1): the best token, stop at EOS
        candidates = candidates[: 1 if width == 1 else self.num_candidates]
        hits = [c[2] in eos or cur_len + 1 >= max_len for c in candidates]

        # finished hypotheses: only the top `width` candidates may finish
        all_full = len(self.finished_hyps) >= width and self.beam.early_stopping is True
        for rank, (cand, hit) in enumerate(zip(candidates, hits, strict=True)):
            if rank < width and hit and self.improvable and not all_full:
                accumulated, b, token, _ = cand
                beam = beams[b]
                self.finished_hyps.append(Hypothesis(
                    beam.output_token_ids + [token],
                    accumulated / ((cur_len + 1 - prompt_len) ** lp), accumulated))
        self.finished_hyps.sort(key=lambda h: -h.score)
        del self.finished_hyps[width:]

        # next running beams: the best `width` candidates, finished ones pushed last
        ranked = sorted(range(len(candidates)),
                        key=lambda i: -(candidates[i][0] + (_NEG if hits[i] else 0.0)))[:width]
        self.pending.clear()
        keep_going = not all(hits)
        next_scores = [candidates[i][0] + (_NEG if hits[i] else 0.0) for i in ranked]
        if keep_going:
            self._reshape(scheduler, beams, [candidates[i] for i in ranked], next_scores)
        # HF's early-stopping heuristic, on the best running beam
        cur_len += 1
        if self.beam.early_stopping == "never" and lp > 0:
            best_len = max_len - prompt_len
        else:
            best_len = cur_len - prompt_len
        best_running = next_scores[0] / (best_len ** lp)
        full = len(self.finished_hyps) >= width
        worst_finished = min(h.score for h in self.finished_hyps) if full else _NEG
        self.improvable = self.improvable and best_running > worst_finished
        stop_all = full and self.beam.early_stopping is True
        if not keep_going or not self.improvable or stop_all:
            for beam in list(self.samples):
                scheduler.finish(beam, "stop")
            self.done = True

    def _reshape(self, scheduler, beams, chosen, next_scores) -> None:
        """Children of each parent: the first continues the parent's sequence, the others
        fork from it first (sharing its blocks); parents without children are freed."""
        children: dict[int, list[tuple[int, float, float]]] = {}
        for (_, b, token, logprob), score in zip(chosen, next_scores, strict=True):
            children.setdefault(b, []).append((token, logprob, score))
        new_beams: list[tuple[Request, int, float, float]] = []
        for b, beam in enumerate(beams):
            kids = children.get(b)
            if not kids:
                scheduler.finish(beam, "stop")
                continue
            for token, logprob, score in kids[1:]:
                self.next_index += 1
                child = Request(beam.request_id, beam.prompt_token_ids, beam.params, beam.seed,
                                beam.metrics, prompt=beam.prompt, cache_salt=beam.cache_salt,
                                sample_index=self.next_index, group=self,
                                token_ids=list(beam.token_ids))
                child.cumulative_logprob = beam.cumulative_logprob
                scheduler.add_fork(beam, child)
                new_beams.append((child, token, logprob, score))
            token, logprob, score = kids[0]
            new_beams.append((beam, token, logprob, score))
        self.samples = []
        self.scores = {}
        for beam, token, logprob, score in sorted(new_beams, key=lambda x: -x[3]):
            beam.token_ids.append(token)
            beam.cumulative_logprob += logprob
            self.scores[id(beam)] = score
            self.samples.append(beam)
        self.forked = True

    def best(self) -> list[Hypothesis]:
        return self.finished_hyps[: self.beam.beam_width]
