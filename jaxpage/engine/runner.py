"""Host -> device: pack a step into padded arrays of bucketed shapes and run the jitted step.

The runner knows nothing about requests: it is given, per sequence, its block table, how
many tokens are cached, the new token ids and (when a token is to be drawn) its sampling
row. With the jnp and Pallas backends each step runs as at most two calls of one jitted
function: the decode tokens (one new token per sequence, `max_query_len` 1) and the prefill
chunks (several tokens per sequence), so the attention of a decode batch never pays for the
longest prompt chunk. The C++ kernel ("cpp") costs each sequence only its own tokens, so a
step mixing both runs as one call.

Every array dimension is padded to a bucket (powers of two; decode batches also at the
1.5x points between them from 8 rows on), so the number of compilations
over any trace is bounded by `max_compiles`; `compiles` counts them as they happen.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention import RAGGED_BACKENDS, build_metadata, init_kv_pool
from jaxpage.sampling import SamplingMetadata, sample
from jaxpage.sampling_params import MAX_LOGPROBS


def power_of_two_buckets(low: int, high: int, *, midpoints: bool = False) -> list[int]:
    """Powers of two from `low` up to the first one >= `high`, capped at `high`; with
    `midpoints`, also 1.5x each of them from 8 on (8, 12, 16, 24, 32, 48, ...)."""
    buckets, size = [], low
    while size < high:
        buckets.append(size)
        if midpoints and size >= 8 and size * 3 // 2 < high:
            buckets.append(size * 3 // 2)
        size *= 2
    buckets.append(high)
    return buckets


def bucket_for(n: int, buckets: list[int]) -> int:
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(slots=True)
class SamplingRow:
    """One sequence's sampling parameters for this step (host side)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    step: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    num_logprobs: int = 0
    prompt_token_ids: list[int] | None = None  # only needed with penalties
    output_token_ids: list[int] | None = None
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS before min_tokens

    @property
    def uses_penalties(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1

    @property
    def uses_filters(self) -> bool:
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0 or self.min_p > 0)


@dataclasses.dataclass(slots=True)
class SeqInput:
    """One sequence of a step: new tokens at positions num_computed.. of its block table."""

    block_table: list[int]
    num_computed: int
    token_ids: list[int]
    # one row per token to draw: none for a non-final prompt chunk, n when the prompt's
    # n samples fork at the end of its prefill
    sampling: list[SamplingRow]


@dataclasses.dataclass(slots=True)
class SeqResult:
    token: int
    logprob: float
    top_logprobs: dict[int, float] | None


def _copy_blocks_fn(kv_pool, src, dst):
    # src, dst: [C] int32; padding copies block 0 onto itself
    # pools are [num_kv_heads, num_blocks, block_size, head_dim]
    return [(k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])) for k, v in kv_pool]


def _forward_fn(model, params, kv_pool, token_ids, positions, attn_md):
    return model.forward(params, token_ids, positions, kv_pool, attn_md)


# Module-level so that every runner of the same model shares compiled executables. The
# forward and the sampler are separate executables: the compile count is then the number of
# batch shapes plus the number of sampling variants, not their product.
_FORWARD = jax.jit(_forward_fn, static_argnums=0, donate_argnums=2)
_SAMPLE = jax.jit(sample)
_COPY_BLOCKS = jax.jit(_copy_blocks_fn, donate_argnums=0)


class ModelRunner:
    """Owns the device params, the KV pool and the compiled step functions."""

    def __init__(
        self,
        model: Any,
        params: Any,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        dtype: Any = jnp.float32,
        backend: str = "jnp",
        interpret: bool = False,
    ) -> None:
        config = model.config
        self.model = model
        self.vocab_size = config.vocab_size
        self.block_size = block_size
        self.backend = backend
        self.ragged = backend in RAGGED_BACKENDS
        self.interpret = interpret
        self.params = jax.device_put(params)
        self.kv_pool = init_kv_pool(config.num_layers, num_blocks, block_size,
                                    config.num_kv_heads, config.head_dim, dtype)
        max_blocks = -(-max_model_len // block_size)
        # Smallest buckets are set where padding is nearly free (a decode step of 8 rows costs
        # what one row costs: both read every weight once) to keep compilations few. Above 8
        # rows a decode step costs about linearly in its rows on CPU, so its buckets are 1.5x
        # apart rather than 2x (padding 33 sequences to 48 rows instead of 64).
        self.token_buckets = power_of_two_buckets(min(16, max_num_batched_tokens),
                                                  max_num_batched_tokens)
        self.decode_buckets = power_of_two_buckets(min(8, max_num_seqs), max_num_seqs,
                                                   midpoints=True)
        self.prefill_seq_buckets = power_of_two_buckets(min(4, max_num_seqs), max_num_seqs)
        self.width_buckets = power_of_two_buckets(
            min(max(1, 64 // block_size), max_blocks), max_blocks)
        self.len_buckets = power_of_two_buckets(min(128, max_model_len), max_model_len)
        self.ban_buckets = power_of_two_buckets(8, max(8, config.vocab_size))
        self.copy_buckets = power_of_two_buckets(min(8, num_blocks), max(1, num_blocks))
        self.compiled: set[tuple] = set()
        self.compile_seconds = 0.0
        self.device_seconds = 0.0  # wall time inside jitted calls (dispatch to result)

    @property
    def compiles(self) -> int:
        return len(self.compiled)

    @property
    def max_compiles(self) -> int:
        """Upper bound on compilations over any trace: every bucket combination."""
        widths = len(self.width_buckets)
        rows = len(self.decode_buckets)  # logits rows
        query_lens = len(self.token_buckets)  # prefill max_query_len <= its token bucket
        forward = (len(self.decode_buckets) + len(self.token_buckets) * query_lens
                   * len(self.prefill_seq_buckets)) * widths * rows
        # greedy x filters x logprobs x (no penalties + widths) x (no bans + widths)
        sampling = rows * 2 * 2 * 2 * (1 + len(self.len_buckets)) * (1 + len(self.ban_buckets))
        return forward + sampling + len(self.copy_buckets)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        size = bucket_for(len(copies), self.copy_buckets)
        src = np.zeros(size, np.int32)
        dst = np.zeros(size, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self.kv_pool = self._timed(("copy", size), lambda: _COPY_BLOCKS(self.kv_pool, src, dst))

    def execute(self, seqs: list[SeqInput]) -> list[list[SeqResult]]:
        """Run one step over `seqs`; returns per sequence one drawn token per sampling row
        (none for a non-final prompt chunk, several for a prompt whose samples fork)."""
        results: list[list[SeqResult]] = [[] for _ in seqs]
        decode = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        prefill = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
        if self.ragged and prefill and decode:  # one call reads the weights once
            prefill, decode = prefill + decode, []
        for group, is_decode in ((prefill, False), (decode, True)):
            if group:
                for i, result in zip(group, self._run([seqs[i] for i in group], is_decode),
                                     strict=True):
                    results[i] = result
        return results

    def _run(self, seqs: list[SeqInput], is_decode: bool) -> list[list[SeqResult]]:
        num_seqs = bucket_for(len(seqs),
                              self.decode_buckets if is_decode else self.prefill_seq_buckets)
        total = sum(len(s.token_ids) for s in seqs)
        num_tokens = num_seqs if is_decode else bucket_for(total, self.token_buckets)
        width = bucket_for(max(-(-(s.num_computed + len(s.token_ids)) // self.block_size)
                               for s in seqs), self.width_buckets)
        # The jnp paths pad every sequence's queries to max_query_len, so it is bucketed from
        # the longest chunk, not from the whole token count. A ragged backend walks each
        # sequence's own queries: one value per token bucket compiles fewer shapes.
        max_query_len = 1 if is_decode else num_tokens if self.ragged else min(
            bucket_for(max(len(s.token_ids) for s in seqs), self.token_buckets), num_tokens)
        # one logits row per draw: a sequence's last token, repeated for forking samples
        last_token = np.cumsum([len(s.token_ids) for s in seqs]) - 1
        rows = [(i, row) for i, s in enumerate(seqs) for row in s.sampling]
        num_rows = bucket_for(max(len(rows), 1), self.decode_buckets)
        positions, attn_md = build_metadata(
            [s.block_table[:width] for s in seqs],
            [s.num_computed for s in seqs],
            [len(s.token_ids) for s in seqs],
            self.block_size,
            max_blocks_per_seq=width,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            logits_indices=[int(last_token[i]) for i, _ in rows],
            num_logits=num_rows,
            backend=self.backend,
            interpret=self.interpret,
        )
        token_ids = np.zeros(num_tokens, np.int32)
        token_ids[:total] = [t for s in seqs for t in s.token_ids]

        def forward():
            logits, self.kv_pool = _FORWARD(self.model, self.params, self.kv_pool, token_ids,
                                            positions, attn_md)
            return logits

        logits = self._timed(("forward", num_tokens, max_query_len, num_seqs, width, num_rows),
                             forward)
        results: list[list[SeqResult]] = [[] for _ in seqs]
        if not rows:  # only non-final prompt chunks: nothing to draw
            return results
        sampling_md = self._sampling_metadata([row for _, row in rows], num_rows)
        sampling_key = ("sample", num_rows, sampling_md.use_filters, sampling_md.num_logprobs,
                        sampling_md.all_greedy,
                        *(None if a is None else a.shape[1] for a in (
                            sampling_md.prompt_token_ids, sampling_md.banned_token_ids)))
        out = self._timed(sampling_key, lambda: jax.device_get(_SAMPLE(logits, sampling_md)))
        for r, (i, row) in enumerate(rows):
            top = None
            if row.num_logprobs:
                n = row.num_logprobs
                top = dict(zip(out["top_ids"][r, :n].tolist(),
                               out["top_logprobs"][r, :n].tolist(), strict=True))
            results[i].append(SeqResult(int(out["tokens"][r]), float(out["logprob"][r]), top))
        return results

    def _timed(self, key: tuple, fn):
        """Run fn; the first call of a shape key is a compilation, timed (to completion) as
        such. Later calls are not synchronized here, so the forward's execution overlaps the
        sampler's dispatch; its time lands in the sampler's device_get."""
        start = time.perf_counter()
        if key in self.compiled:
            result = fn()
            self.device_seconds += time.perf_counter() - start
            return result
        result = jax.block_until_ready(fn())
        self.compile_seconds += time.perf_counter() - start
        self.compiled.add(key)
        return result

    def _sampling_metadata(self, rows: list[SamplingRow], num_rows: int):
        greedy = SamplingRow(0.0, 1.0, 0, 0.0, 0, 0)
        rows = rows + [greedy] * (num_rows - len(rows))
        use_penalties = any(r.uses_penalties for r in rows)
        md = dict(
            temperature=np.array([r.temperature for r in rows], np.float32),
            top_p=np.array([r.top_p for r in rows], np.float32),
            top_k=np.array([max(r.top_k, 0) for r in rows], np.int32),
            min_p=np.array([r.min_p for r in rows], np.float32),
            seeds=np.array([r.seed & 0xFFFFFFFF for r in rows], np.uint32),
            steps=np.array([r.step for r in rows], np.int32),
            use_filters=any(r.uses_filters for r in rows),
            all_greedy=all(r.temperature == 0 for r in rows),
            num_logprobs=MAX_LOGPROBS if any(r.num_logprobs for r in rows) else 0,
        )
        if any(r.banned_token_ids for r in rows):
            width = bucket_for(max(len(r.banned_token_ids) for r in rows), self.ban_buckets)
            md["banned_token_ids"] = _pad_rows([r.banned_token_ids for r in rows], width)
        if use_penalties:
            longest = max(max(len(r.prompt_token_ids or ()), len(r.output_token_ids or ()))
                          for r in rows)
            width = bucket_for(max(longest, 1), self.len_buckets)
            md.update(
                presence=np.array([r.presence for r in rows], np.float32),
                frequency=np.array([r.frequency for r in rows], np.float32),
                repetition=np.array([r.repetition for r in rows], np.float32),
                prompt_token_ids=_pad_rows([r.prompt_token_ids or () for r in rows], width),
                output_token_ids=_pad_rows([r.output_token_ids or () for r in rows], width),
                use_penalties=True,
            )
        return SamplingMetadata(**md)


def _pad_rows(rows: list, width: int) -> np.ndarray:
    out = np.full((len(rows), width), -1, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out

