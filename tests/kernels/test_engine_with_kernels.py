"""The engine with each attention backend forced (the Pallas decode kernels in interpret mode
on CPU) generates exactly the dense reference backend's greedy tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams
from pallas_kernels import cpu_attention

pytestmark = pytest.mark.kernels


needs_cpp = pytest.mark.skipif(not cpu_attention.available(),
                               reason="the C++ kernel could not be built here")


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "jnp", "pallas_gpu",
                                     "pallas_tpu"])
def test_engine_greedy_tokens_match_reference_backend(hf_model_dir, backend):
    path, _ = hf_model_dir("qwen3")  # 6 query heads on 2 KV heads, head_dim 16
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (5, 16, 23)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kwargs = dict(block_size=8, num_blocks=32, max_num_batched_tokens=64, max_num_seqs=4)
    reference = LLM(path, attention_backend="reference", **kwargs).generate(
        prompts, params, use_tqdm=False)
    interpret = backend.startswith("pallas")
    kernel_llm = LLM(path, attention_backend=backend, kernel_interpret=interpret, **kwargs)
    assert kernel_llm.engine.runner.backend == backend
    outs = kernel_llm.generate(prompts, params, use_tqdm=False)
    for ref, out in zip(reference, outs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_kernel_backend_on_the_wrong_platform_is_refused(hf_model_dir):
    path, _ = hf_model_dir("qwen3")
    with pytest.raises(ValueError, match="kernel_interpret"):
        LLM(path, attention_backend="pallas_tpu", num_blocks=8)


@needs_cpp
def test_auto_backend_on_cpu_is_the_cpp_kernel_for_float32_only(hf_model_dir):
    path, _ = hf_model_dir("qwen3")
    assert LLM(path, num_blocks=8).engine.runner.backend == "cpp"
    assert LLM(path, num_blocks=8, dtype="bfloat16").engine.runner.backend == "jnp"
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(path, num_blocks=8, dtype="bfloat16", attention_backend="cpp")


@pytest.mark.parametrize("env", [{"CXX": "false"}, {"JAXPAGE_NO_CPU_KERNEL": "1"}])
def test_without_the_kernel_auto_falls_back_to_jnp(tmp_path, env, hf_model_dir):
    """A compiler that fails (or the opt-out) leaves the engine on the jnp path, with a
    warning naming why when the build failed."""
    path, _ = hf_model_dir("qwen3")
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from jaxpage import LLM\n"
            f"print(LLM({str(path)!r}, num_blocks=8).engine.runner.backend)\n")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAXPAGE_CACHE": str(tmp_path), **env})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "jnp"
    if "CXX" in env:
        assert "CPU attention kernel unavailable" in result.stderr
