"""The Pallas kernels compiled for the accelerator they are written for (not interpreted):
run with `python -m pytest -m gpu` on a CUDA GPU or `-m tpu` on a TPU; skipped elsewhere.

The same batches as tests/kernels/test_ragged_kernels.py (mixed and pure decode, NaN in
every unowned pool slot; its full product of query heads per KV head, head dims, block size
and dtype) against the float64 oracle and the dense reference, and the engine with the
platform's backend against the reference backend's greedy tokens in float32 at full matmul
precision. `scripts/bench_kernels.py` checks the same on hardware before it times anything.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_engine_with_kernels import mixed_requests, mixed_workload
from test_ragged_kernels import (
    DTYPES,
    FULL_PRODUCT,
    HEAD_DIMS,
    assert_matches,
    decode_batch_spec,
    dense_oracle,
    make_batch,
    mixed_batch_spec,
)

from jaxpage import LLM, SamplingParams
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.paged_decode_tpu import paged_decode_attention_tpu
from pallas_kernels.ragged_paged_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_tpu import ragged_paged_attention_tpu

PLATFORMS = {
    "gpu": (ragged_paged_attention_gpu, paged_decode_attention_gpu, "pallas_gpu"),
    "tpu": (ragged_paged_attention_tpu, paged_decode_attention_tpu, "pallas_tpu"),
}
ON = [pytest.param(p, marks=[getattr(pytest.mark, p), pytest.mark.skipif(
    jax.default_backend() != p, reason=f"needs a {p.upper()}")]) for p in PLATFORMS]


@pytest.mark.parametrize("platform", ON)
@pytest.mark.parametrize("group,head_dims,block_size,dtype_name", FULL_PRODUCT)
def test_ragged_kernel_on_device(platform, group, head_dims, block_size, dtype_name):
    dtype = DTYPES[dtype_name]
    for spec in (mixed_batch_spec, decode_batch_spec):
        inputs, max_query_len = make_batch(spec(block_size), group=group,
                                           head_dims=HEAD_DIMS[head_dims],
                                           block_size=block_size, dtype=dtype, seed=group)
        out = PLATFORMS[platform][0](*inputs, max_query_len=max_query_len)
        assert_matches(out, inputs, max_query_len, dtype)


@pytest.mark.parametrize("platform", ON)
def test_decode_kernel_on_device(platform):
    """The decode wrapper: sequence s's one query at row s (padding rows between)."""
    inputs, _ = make_batch(decode_batch_spec(16), group=4, head_dims=(128, 128), block_size=16,
                           dtype=np.float32, seed=3)
    q, k_pool, v_pool, tables, lens, starts = (np.asarray(x) for x in inputs)
    live = np.flatnonzero(lens)
    q_rows = np.zeros((len(lens), *q.shape[1:]), np.float32)
    q_rows[live] = q[starts[live]]
    out = np.asarray(PLATFORMS[platform][1](q_rows, k_pool, v_pool, tables, lens))
    expected = dense_oracle(*inputs)
    np.testing.assert_allclose(out[live], expected[starts[live]], rtol=0,
                               atol=1e-5 * np.abs(expected).max())
    assert (out[lens == 0] == 0).all()


@pytest.mark.parametrize("platform", ON)
def test_engine_on_device_matches_reference_tokens(platform, hf_model_dir):
    path, _ = hf_model_dir("qwen3")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    requests = mixed_requests(params, 23)
    kwargs = dict(block_size=16, num_blocks=48, max_num_batched_tokens=16, max_num_seqs=4)
    with jax.default_matmul_precision("highest"):
        expected = mixed_workload(LLM(path, attention_backend="reference", **kwargs).engine,
                                  requests)
        engine = LLM(path, attention_backend=PLATFORMS[platform][2], **kwargs).engine
        assert mixed_workload(engine, requests) == expected
