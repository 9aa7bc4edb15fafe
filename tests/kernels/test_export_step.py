"""The whole engine step (model forward with the ragged kernel inside, pool donated) exported
for TPU and CUDA at SmolLM2-135M and Llama-3-8B shapes: it lowers, every pool argument is
aliased to an output, and nothing but the kernel and the K/V write touches the pool (no pad,
copy, concatenate or transpose of it). `scripts/export_step.py` does the exporting and the
reading of the module; these tests hold its findings, and hold the reader itself to a module
that does copy its pool."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                "scripts"))

import export_step  # noqa: E402

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("step", list(export_step.STEPS))
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("model", list(export_step.MODELS))
def test_engine_step_exports_with_the_pool_untouched_outside_the_kernel(model, platform, step):
    result = export_step.export_step(model, platform, step)
    layers = export_step.MODELS[model].num_layers
    assert result.num_pool_args == 2 * layers
    assert result.aliased_pool_args == 2 * layers  # donation holds: the pool updates in place
    assert result.has_kernel
    assert result.kernel_calls == layers  # each layer hands its pools to the kernel once
    assert result.kv_writes == 2 * layers  # one scatter per layer and pool (K, V)
    assert result.foreign_ops == []


def test_the_reader_finds_a_per_call_pad_of_the_pool():
    """The previous TPU decode path padded each layer's head_dim-64 pools to 128 lanes on
    every call: per layer and pool it read the pool (3 x 4096 x 32 x 64 bf16 = 48 MiB) and
    wrote twice that."""
    pool = 3 * 4096 * 32 * 64 * 2
    assert export_step.before_bytes("smollm2-135m") == 30 * 2 * (pool + 2 * pool)
