"""cpu_ops.greedy_draw (cpu/sampling.h's JaxpageGreedyDraw) against a float64 NumPy
oracle, and the sampler's greedy rows, which take it on CPU, against its XLA path.

Tokens are exact: each row's first maximum (its first NaN where it has one), as np.argmax and
jnp.argmax give. The log-probability m - (log(s) + m), s = sum(exp(x - m)), is float32: each
exponential within a few ulp (`exp_nonpositive`), the sum a chain of at most V / 16 + 16
additions of positive terms (16 lanes, then across them), each adding one rounding of the
partial sum, so s is within (V / 16 + 20) * 2^-24 relative of the float64 sum; log adds that as
an absolute error, and the two roundings of log(s) + m and its subtraction add 2^-24 times their
magnitudes. `bound` is that sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage import sampling
from jaxpage.sampling_params import SamplingParams, SamplingRow
from pallas_kernels import cpu_ops

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_ops.available(),
                                 reason="the CPU kernel library is not available")]

EPS = 2.0**-24


def oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    tokens = np.argmax(x64, axis=-1)  # first maximum, first NaN if any
    top = x64.max(axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.exp(x64 - top[:, None]).sum(axis=-1)
        logprob = x64[np.arange(len(x)), tokens] - (np.log(s) + top)
    return tokens, logprob


def bound(x: np.ndarray) -> np.ndarray:
    top = x.astype(np.float64).max(axis=-1)
    log_s = np.log(np.exp(x.astype(np.float64) - top[:, None]).sum(axis=-1))
    return EPS * ((x.shape[1] / 16 + 20) + 4 * (np.abs(top) + log_s + 1))


# (rows, vocab): a lone row, vocabularies below a vector, of whole vectors, with a tail, and
# SmolLM2's 49,152 at the decode buckets' sizes
SHAPES = [(1, 1), (2, 15), (3, 16), (1, 97), (5, 1000), (8, 49152), (64, 49159)]


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_tokens_exact_and_logprobs_within_the_float32_bound(rows, vocab):
    rng = np.random.default_rng(rows * 1000 + vocab)
    x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    if vocab > 2:  # ties: the first of equal maxima wins, in another lane or in the tail
        x[0, vocab // 3] = x[0, vocab - 1] = x[0].max() + 1.0
    if rows > 1 and vocab > 17:
        x[1, 17] = x[1, 1] = x[1].max() + 2.0  # the same lane of two vectors
    tokens, logprob = jax.jit(cpu_ops.greedy_draw)(jnp.asarray(x))
    want_tokens, want_logprob = oracle(x)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
    err = np.abs(np.asarray(logprob, np.float64) - want_logprob)
    assert (err <= bound(x)).all(), (err.max(), bound(x).min())


def test_a_rows_draw_does_not_depend_on_the_thread_that_draws_it():
    """Rows are shared among the caller and XLA's intra-op threads, whichever claims one first:
    a row's draw must be the same on either (and alone in a call of one row), bit for bit, or
    an engine's log-probabilities change from run to run. Eight random rows, each 64 times
    over in one call (both threads draw copies of each), ten calls, against each row drawn
    alone. (When each call site compiled its own copy of the rows' loop, -fassociative-math
    ordered the two copies' sums apart: one ulp on about a third of such calls.)"""
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((8, 1000)) * 4).astype(np.float32)
    draw = jax.jit(cpu_ops.greedy_draw)
    alone = [np.asarray(draw(jnp.asarray(row[None]))[1])[0] for row in rows]
    want = np.tile(np.asarray(alone, np.float32), 64)
    for _ in range(10):
        logprob = np.asarray(draw(jnp.asarray(np.tile(rows, (64, 1))))[1])
        np.testing.assert_array_equal(logprob, want)


def test_nan_and_infinite_rows_follow_argmax_and_the_logsumexp_formula():
    x = np.zeros((5, 40), np.float32)
    x[0, 7] = x[0, 30] = np.nan  # first NaN
    x[1] = -np.inf                # every token banned: index 0
    x[2, 5] = x[2, 35] = np.inf   # first +inf
    x[3, 39] = np.nan             # a NaN in the tail, after the vectors
    x[4, 3] = -np.inf             # one -inf among finite logits: an ordinary row
    tokens, logprob = cpu_ops.greedy_draw(jnp.asarray(x))
    xla_tokens = sampling.argmax(jnp.asarray(x))
    xla_logprob = (jnp.take_along_axis(jnp.asarray(x), xla_tokens[:, None], axis=-1)[:, 0]
                   - jax.nn.logsumexp(jnp.asarray(x), axis=-1))
    np.testing.assert_array_equal(np.asarray(tokens), [7, 0, 5, 39, 0])
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(xla_tokens))
    assert np.isnan(np.asarray(logprob)[:4]).all() and np.isnan(np.asarray(xla_logprob)[:4]).all()
    assert abs(float(logprob[4]) - (-np.log(39.0))) < 1e-6  # 39 zeros share the mass


def test_empty_batch_and_bad_shapes():
    tokens, logprob = cpu_ops.greedy_draw(jnp.zeros((0, 8), jnp.float32))
    assert tokens.shape == logprob.shape == (0,)
    for shape in [(8,), (2, 0)]:
        with pytest.raises(ValueError, match="greedy_draw takes logits"):
            cpu_ops.greedy_draw(jnp.zeros(shape, jnp.float32))


@pytest.mark.parametrize("bans", [False, True])
def test_the_samplers_greedy_rows_equal_its_xla_path(bans):
    """sampling.sample's greedy rows without top logprobs take the kernel on CPU; with banned
    tokens (processed logits) they keep XLA's path. Either way the tokens are the XLA path's
    and the log-probability is the raw distribution's."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray((rng.standard_normal((8, 3000)) * 3).astype(np.float32))
    banned = [int(np.argmax(logits[0]))] if bans else []
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0,
                        banned_token_ids=tuple(banned))] * 8
    md = sampling.SamplingMetadata.pack(rows, 8, ban_buckets=[8, 4096],
                                        history_buckets=[128], vocab_size=3000)
    got = jax.jit(sampling.sample)(logits, md)
    processed = logits.at[:, banned].set(-jnp.inf) if bans else logits
    want_tokens = sampling.argmax(processed)
    want_logprob = (jnp.take_along_axis(logits, want_tokens[:, None], axis=-1)[:, 0]
                    - jax.nn.logsumexp(logits, axis=-1))
    np.testing.assert_array_equal(np.asarray(got["tokens"]), np.asarray(want_tokens))
    np.testing.assert_allclose(np.asarray(got["logprob"]), np.asarray(want_logprob), atol=1e-5)
    text = jax.jit(sampling.sample).lower(logits, md).as_text()
    assert ("jaxpage_greedy_draw" in text) == (not bans)
