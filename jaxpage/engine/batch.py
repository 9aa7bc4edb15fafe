"""What crosses between the scheduler and the runner each step: plain ints and lists (no JAX).

The scheduler describes each scheduled sequence as a `SeqInput`; the runner returns, per
sequence, one `SeqResult` per token it drew. Neither side sees the other's objects: the
runner knows no requests, the scheduler no arrays.
"""

from __future__ import annotations

import dataclasses

from jaxpage.sampling_params import SamplingRow


@dataclasses.dataclass(slots=True)
class SeqInput:
    """One sequence of a step: new tokens at positions num_computed.. of its block table."""

    block_table: list[int]
    num_computed: int
    token_ids: list[int]
    # one row per token to draw: none for a non-final prompt chunk, n when the prompt's
    # n samples fork at the end of its prefill
    sampling: list[SamplingRow]
    # the window group's table (sliding-window layers' pool), for models with such layers
    window_block_table: list[int] | None = None
    # the scheduler's word that, unless its draw ends it, this decode sequence goes on to the
    # next position with that draw and nothing else changed (one sample, no penalties' token
    # history, no beam, below its length limits): the runner may start that step before it
    # reads this one's draw (ModelRunner.lookahead_rows)
    may_run_ahead: bool = False
    # the scheduler's word that this decode's draw is its last (by length): no step follows
    # it, so a step run ahead of this one leaves it out
    ends: bool = False
    # speculative decoding: token_ids are the sequence's last token and its drafts, and
    # sampling holds one row per token, each drawn from the logits at that token (not all
    # at the last one)
    verify: bool = False
    # the device slot of the LoRA adapter the sequence runs with (0: none; jaxpage.lora)
    lora_slot: int = 0
    # prompt log-probabilities: sampling[:num_scores] are rows scoring the prompt tokens
    # that follow token_ids[score_from:score_from + num_scores], each drawn from the logits
    # at its token and forced to the prompt's next token (SamplingRow.forced_token)
    num_scores: int = 0
    score_from: int = 0


@dataclasses.dataclass(slots=True)
class SeqResult:
    """One drawn token: its id, its log-probability under the model's raw distribution, and
    (when asked for) the top log-probabilities {token id: log-prob}, best first."""

    token: int
    logprob: float
    top_logprobs: dict[int, float] | None
