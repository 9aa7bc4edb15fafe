"""RequestOutputs from request state: per-sample streaming deltas and beam results (no JAX)."""

from __future__ import annotations

from typing import Any

from jaxpage.engine.beam_search import BeamGroup
from jaxpage.engine.detokenizer import IncrementalDetokenizer
from jaxpage.engine.request import Request, RequestGroup, RequestStatus
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.sampling_params import RequestOutputKind

_DELTA = RequestOutputKind.DELTA
_FINISHED = RequestStatus.FINISHED


def sample_deltas(group: RequestGroup, starts: dict[Request, int],
                  detokenizers: dict[str, IncrementalDetokenizer],
                  finished: bool | None = None) -> RequestOutput:
    """The group's output as its `output_kind` asks. DELTA: for each changed sample, its
    tokens from `starts[sample]` and the text not shown yet (a possible partial stop string
    is held back while it runs). CUMULATIVE and FINAL_ONLY: every sample's tokens and text
    so far. `finished`: group.finished, when the caller has it already."""
    completions = []
    parent = group.samples[0]
    whole = parent.params.output_kind is not _DELTA
    items = [(sample, 0) for sample in group.samples] if whole else starts.items()
    for sample, first in sorted(items, key=_by_index) if len(items) > 1 else items:
        detok = detokenizers.get(sample.seq_id)
        text = (sample.text if detok is None
                else detok.streamable_text(sample.status is _FINISHED))
        start_char = 0 if whole else sample.num_text_emitted
        if len(text) > start_char:
            sample.num_text_emitted = len(text)
        logprobs = sample.logprobs
        completions.append(CompletionOutput(
            sample.sample_index,
            text[start_char:],
            sample.token_ids[len(sample.prompt_token_ids) + first:],
            sample.cumulative_logprob,
            None if logprobs is None else logprobs[first:],
            sample.finish_reason,
            sample.stop_reason,
        ))
    scored = parent.prompt_logprobs
    return RequestOutput(group.request_id, parent.prompt, parent.prompt_token_ids,
                         completions, group.finished if finished is None else finished,
                         parent.metrics, prompt_logprobs=None if scored is None
                         or len(scored) < len(parent.prompt_token_ids) else scored)


def _by_index(item: tuple[Request, int]) -> int:
    return item[0].sample_index


def beam_output(group: BeamGroup, reason: str, tokenizer: Any) -> RequestOutput:
    """The best hypotheses, best first; one that ended on EOS has finish_reason "stop"."""
    completions = []
    for index, hyp in enumerate(group.best()):
        ended = bool(hyp.token_ids) and hyp.token_ids[-1] in group.eos_token_ids and (
            not group.beam.ignore_eos)
        text = "" if tokenizer is None else tokenizer.decode(hyp.token_ids,
                                                              skip_special_tokens=True)
        completions.append(CompletionOutput(
            index=index, text=text, token_ids=list(hyp.token_ids),
            cumulative_logprob=hyp.cumulative_logprob,
            finish_reason="abort" if reason == "abort" else ("stop" if ended else "length"),
            stop_reason=hyp.token_ids[-1] if ended else None))
    root = group.samples[0]
    return RequestOutput(group.request_id, root.prompt, root.prompt_token_ids, completions,
                         True, root.metrics)
