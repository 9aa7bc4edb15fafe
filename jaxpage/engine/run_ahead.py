"""Decode steps run ahead of the host (`ModelRunner._run_ahead`): the records of a step on its
way, the test of whether a step run ahead is the one the scheduler now asks for, and the small
jitted functions that make a run-ahead step's token ids and inputs on the device.

A decode step of rows that go on is followed, before its draws reach the host, by the step
after it: its token ids are the draws themselves (`NEXT_TOKENS`, `PICK_TOKENS`), and where the
step was a pure decode whose inputs stayed on the device (`DecodeInputs`) its positions,
slots, lengths and sampling counters are moved one on there (`ADVANCE`). The next `execute`
takes each row of it that is the same computation (`same_seq`, `ahead_rows`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.engine.batch import SeqInput
from jaxpage.sampling import SamplingMetadata
from jaxpage.sampling_params import SamplingRow


@dataclasses.dataclass(slots=True)
class Step:
    """A step on its way: its sequences' count, its draws (sequence index, row), their rows'
    bucket, and the sampler's outputs on the device (None: nothing drawn)."""

    num_seqs: int
    rows: list[tuple[int, SamplingRow]]
    num_rows: int
    drawn: dict[str, jax.Array] | None = None
    inputs: DecodeInputs | None = None  # a decode step's, kept on the device for the next


@dataclasses.dataclass(slots=True)
class DecodeInputs:
    """A pure decode step's inputs as dispatched, on the device (one token, one draw a
    sequence, row i sequence i), from which the step after it is made by `ADVANCE`: its
    forward's shape key and its tokens' LoRA slots (None: no adapter; the adapters' stacks
    are the runner's at the time, as a slot load replaces them), positions and attention
    metadata, the sampler's key and metadata, the block-table width, and the block tables
    as packed on the host (the full group's, then the window group's where there is one:
    each as its rows' lists cut to the width and as the [S, width] array uploaded), so that
    a row whose table changed since is known."""

    key: tuple
    lora_slots: np.ndarray | None
    positions: jax.Array
    attn_md: Any
    sampling_key: tuple
    sampling_md: SamplingMetadata
    width: int
    tables: list[list[list[int]]]
    packed: list[np.ndarray]


@dataclasses.dataclass(slots=True)
class Ahead:
    """A decode step started before the step it follows was read back: its inputs (their
    token ids filled in once that step's draws are read), the step, and for each of its
    sequences the index of the one it follows in that step."""

    seqs: list[SeqInput]
    step: Step
    sources: list[int]


@dataclasses.dataclass(slots=True)
class Served:
    """A decode step as it was run: the steps that drew its rows (a run-ahead step and/or a
    call of its own) and, per row, (which of them, its row there)."""

    steps: list[Step]
    rows: list[tuple[int, int]]


def same_seq(x: SeqInput, y: SeqInput, block_size: int, window: int | None = None) -> bool:
    """Whether two decode rows are the same computation: the same blocks under their tokens
    (past them a table may have grown since: the scheduler takes a block a step before it is
    written, and attention reads no block past a sequence's length; and with a `window`,
    before the first block the row's window reads, which the window group releases as the
    window moves on), position, tokens and sampling rows (`may_run_ahead` aside)."""
    used = -(-(x.num_computed + len(x.token_ids)) // block_size)
    first = 0 if window is None else max(0, (x.num_computed - window + 1) // block_size)
    return (x.num_computed == y.num_computed and x.token_ids == y.token_ids
            and x.block_table[:used] == y.block_table[:used] and x.sampling == y.sampling
            and (x.window_block_table is None  # (a runner's rows all have one, or none)
                 or x.window_block_table[first:used] == y.window_block_table[first:used])
            and x.lora_slot == y.lora_slot)


def ahead_rows(ahead: list[SeqInput], seqs: list[SeqInput], block_size: int,
               window: int | None = None) -> list[int | None]:
    """For each decode row of `seqs`, the row of the run-ahead step `ahead` that is the same
    computation (`same_seq`), or None. Rows pair by the block a row writes its token into
    and its position: a sequence writes only into a block it holds alone, so no two live
    rows share both."""
    if len(ahead) == len(seqs) and all(
            same_seq(a, s, block_size, window) for a, s in zip(ahead, seqs, strict=True)):
        return list(range(len(seqs)))  # the common case: the same rows in the same order

    def key(s: SeqInput) -> tuple[int, int]:
        return s.num_computed, s.block_table[s.num_computed // block_size]

    index = {key(s): j for j, s in enumerate(ahead)}
    rows: list[int | None] = []
    for s in seqs:
        j = index.pop(key(s), None)  # popped: a row serves one sequence
        rows.append(j if j is not None and same_seq(ahead[j], s, block_size, window)
                    else None)
    return rows


def next_row(row: SamplingRow) -> SamplingRow:
    """`row`'s draw at the next output position (a run-ahead step's row). With penalties its
    output history ends in a placeholder (-1, which packs as padding) for the token `row`
    draws: the device writes that token there (`APPEND_HISTORY`), the host once it reads it
    (`fill_history`)."""
    output = row.output_token_ids
    if row.params.uses_penalties:
        output = [*output, -1]
    return SamplingRow(row.params, row.seed, row.step + 1, row.prompt_token_ids, output,
                       row.banned_token_ids, row.matcher, row.drafted, row.forced_token)


def history_slots(rows: list[SamplingRow]) -> list[int] | None:
    """Where each run-ahead row's placeholder (`next_row`) lies in its output history (-1:
    no penalties), or None when no row has one."""
    slots = [len(r.output_token_ids) - 1 if r.params.uses_penalties else -1 for r in rows]
    return slots if max(slots) >= 0 else None


def fill_history(row: SamplingRow, token: int) -> None:
    """Put the token the step before drew in a run-ahead row's placeholder (`next_row`)."""
    if row.params.uses_penalties:
        row.output_token_ids[-1] = token


def advance_fn(block_size, n, positions, attn_md, steps):
    """A decode step's inputs one position on, on the device: the inputs of the step after
    it in which its first `n` sequences each go on with one token (their tables as they
    were; padding as build_metadata lays it: position, slot and length 0). The draws'
    counters (`steps`, one row a sequence) go on with them."""
    live = (jnp.arange(positions.shape[0]) < n).astype(jnp.int32)
    positions = positions + live
    rows = jnp.arange(positions.shape[0])

    def slots(tables):
        return live * (tables[rows, positions // block_size] * block_size
                       + positions % block_size)

    window = attn_md.window_block_tables
    attn_md = dataclasses.replace(
        attn_md, slot_mapping=slots(attn_md.block_tables),
        seq_lens=attn_md.seq_lens + (jnp.arange(attn_md.seq_lens.shape[0]) < n),
        window_slot_mapping=None if window is None else slots(window))
    return positions, attn_md, steps + (jnp.arange(steps.shape[0]) < n)

# a decode step's drawn tokens as the next step's token ids (padding rows: 0)
NEXT_TOKENS = jax.jit(lambda drawn, n: jnp.where(jnp.arange(drawn.shape[0]) < n, drawn,
                                                 0).astype(jnp.int32))
# the same, the rows picked by `rows` out of one or two steps' draws laid end to end (a step
# served partly by a run-ahead step, partly by a call of its own)
PICK_TOKENS = jax.jit(lambda rows, n, *drawn: jnp.where(
    jnp.arange(rows.shape[0]) < n, jnp.concatenate(drawn)[rows], 0).astype(jnp.int32))
ADVANCE = jax.jit(advance_fn, static_argnums=0)


def append_history_fn(output_ids, slots, tokens):
    """A run-ahead step's sampler history on the device: row r's `tokens[r]` (the token the
    step before drew for it, row r sequence r) written at `slots[r]` of its [R, width]
    output ids (a slot past the width: none)."""
    rows = output_ids.shape[0]
    tokens = jnp.zeros(rows, jnp.int32).at[:tokens.shape[0]].set(tokens[:rows])
    return output_ids.at[jnp.arange(rows), slots].set(tokens, mode="drop")


APPEND_HISTORY = jax.jit(append_history_fn)
