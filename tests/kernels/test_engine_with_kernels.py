"""The engine with each attention backend forced (the ragged Pallas kernels in interpret mode
on CPU) generates exactly the dense reference backend's greedy tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import add_due, build_hf_model

from jaxpage import LLM, SamplingParams, layers
from jaxpage.attention import RAGGED_BACKENDS, pool_head_dim
from pallas_kernels import cpu_ops

pytestmark = pytest.mark.kernels


needs_cpp = pytest.mark.skipif(not cpu_ops.available(),
                               reason="the C++ kernel could not be built here")


def mixed_requests(params, chunked_len: int) -> list[tuple]:
    """The mixed workload as `(request_id, prompt, params, step to add it at)` items (for
    conftest.add_due): chunked prompts (`chunked_len` tokens and a shared 24-token prefix +
    16 under a 16-token budget), prompts arriving while others decode (steps 3 and 8:
    decode tokens and chunks in one step) and prompts sharing the prefix with earlier ones
    (prefix-cache hits, so chunks start mid-sequence and mid-block)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 97, size=24).tolist()
    prompts = {"a": rng.integers(3, 97, size=5).tolist(), "b": shared + [5, 6, 7],
               "c": rng.integers(3, 97, size=chunked_len).tolist(), "d": shared + [9] * 16,
               "e": shared + [11], "f": rng.integers(3, 97, size=1).tolist()}
    steps = {"a": 0, "b": 0, "c": 3, "d": 3, "e": 8, "f": 8}
    return [(rid, prompt, params, steps[rid]) for rid, prompt in prompts.items()]


def mixed_workload(engine, requests: list[tuple]) -> dict[str, list[int]]:
    """Run `requests` (as mixed_requests gives them) through `engine` to the end; returns
    each request's tokens. The engine's runner is spied on (the real `execute` still runs)
    so the test can see that steps mixing decode tokens and prompt chunks happened."""
    runner = engine.runner
    real_execute = runner.execute
    runner.mixed_steps = 0

    def execute(seqs):
        lengths = {len(s.token_ids) == 1 for s in seqs}
        runner.mixed_steps += lengths == {True, False}
        return real_execute(seqs)

    runner.execute = execute
    return run_to_end(engine, requests)[0]


def run_to_end(engine, requests: list[tuple]) -> tuple[dict, dict]:
    """Each request's tokens and their log-probs (where asked) as `engine` streams them (the
    requests' default output kind, DELTA: each step's new tokens), `requests` added at their
    steps (conftest.add_due)."""
    pending = list(requests)
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    logprobs: dict[str, list] = {rid: [] for rid, *_ in requests}
    for step in range(200):
        add_due(engine, pending, step)
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            logprobs[out.request_id] += out.outputs[0].logprobs or []
        if not pending and not engine.has_unfinished_requests():
            return tokens, logprobs
    raise AssertionError("the workload did not finish in 200 steps")


# the TPU kernel through the engine is slow (34 s under the TPU interpreter on a 2-core Zen 3);
# its kernel tests run by default
@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "jnp", "pallas_gpu",
                                     pytest.param("pallas_tpu", marks=pytest.mark.slow)])
def test_engine_greedy_tokens_match_reference_backend(hf_model_dir, backend):
    """A mixed workload: chunked prompts (a 16-token budget cuts the 23- and 40-token ones),
    prompts arriving while others decode (steps of decode tokens and chunks together), and
    prompts sharing a 24-token prefix with earlier ones (prefix-cache hits, so chunks start
    mid-sequence and mid-block)."""
    path, _ = hf_model_dir("qwen3")  # 6 query heads on 2 KV heads, head_dim 16
    requests = mixed_requests(SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), 23)
    kwargs = dict(block_size=8, num_blocks=48, max_num_batched_tokens=16, max_num_seqs=4,
                  enable_prefix_caching=True)
    expected = mixed_workload(LLM(path, attention_backend="reference", **kwargs).engine,
                              requests)
    interpret = backend.startswith("pallas")
    engine = LLM(path, attention_backend=backend, kernel_interpret=interpret, **kwargs).engine
    assert engine.runner.backend == backend
    assert mixed_workload(engine, requests) == expected
    assert engine.stats()["prefix_cache_hits"] > 0
    if backend in RAGGED_BACKENDS:
        assert engine.runner.mixed_steps > 0
    # the pool is allocated in the layout the kernel reads: 128 lanes on TPU for head_dim 16
    assert engine.runner.kv_pool[0][0].shape[-1] == pool_head_dim(backend, 16)


def test_kernel_backend_on_the_wrong_platform_is_refused(hf_model_dir):
    path, _ = hf_model_dir("qwen3")
    with pytest.raises(ValueError, match="kernel_interpret"):
        LLM(path, attention_backend="pallas_tpu", num_blocks=8)


@needs_cpp
def test_auto_backend_on_cpu_is_the_cpp_kernel_for_float32_and_bfloat16(hf_model_dir):
    """Both engine dtypes; other pool dtypes are refused by cpu_ops.unsupported_reason
    (tests/kernels/test_cpu_attention.py::test_unsupported_pools_are_named)."""
    path, _ = hf_model_dir("qwen3")
    assert LLM(path, num_blocks=8).engine.runner.backend == "cpp"
    assert LLM(path, num_blocks=8, dtype="bfloat16").engine.runner.backend == "cpp"


@needs_cpp
@pytest.mark.parametrize("bf16_mode", ["dot", "portable"])
def test_bf16_engine_greedy_tokens_match_reference_backend(tmp_path, monkeypatch, bf16_mode):
    """A bfloat16 engine on the C++ kernel (head_dim 64 by blocks of 16: the sizes the
    AVX512-BF16 path serves; `portable` forces the fallback) generates the bfloat16 reference
    backend's greedy tokens over chunked prompts, decode steps mixed with chunks and
    prefix-cache hits. Where a token differs, it must be a near-tie of the reference's logits
    (top-2 margin under bf16's resolution of the logits), not a wrong attention."""
    if bf16_mode == "dot" and not cpu_ops.bf16_dot_compiled():
        pytest.skip("this build has no AVX512-BF16 path")
    monkeypatch.setenv("JAXPAGE_CPU_KERNEL_BF16", bf16_mode)
    build_hf_model("qwen3", head_dim=64).save_pretrained(tmp_path, safe_serialization=True)
    requests = mixed_requests(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), 37)
    prompts = {rid: prompt for rid, prompt, _, _ in requests}
    kwargs = dict(block_size=16, num_blocks=48, max_num_batched_tokens=16, max_num_seqs=4,
                  enable_prefix_caching=True, dtype="bfloat16")
    expected = mixed_workload(LLM(str(tmp_path), attention_backend="reference", **kwargs).engine,
                              requests)
    engine = LLM(str(tmp_path), attention_backend="cpp", **kwargs).engine
    assert engine.runner.backend == "cpp"
    assert engine.runner.kv_pool[0][0].dtype == np.dtype("bfloat16")
    tokens = mixed_workload(engine, requests)
    assert engine.stats()["prefix_cache_hits"] > 0 and engine.runner.mixed_steps > 0
    assert tokens == expected, _first_divergence(str(tmp_path), kwargs, prompts, tokens,
                                                 expected)


@needs_cpp
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    "qwen3"])
def test_stacked_layers_give_the_per_layer_tokens(hf_model_dir, monkeypatch, family):
    """On the C++ kernel a Llama-family model keeps its layers stacked (one array a param name,
    read in place: `layers.StackedLayers`), Qwen2's biases and Qwen3's q/k norms stacked
    beside its weights (their layers run unfused, the vectors sliced out); the stacked
    engine's tokens and log-probs over the mixed workload (chunked prompts, unfused, beside
    decodes, fused where the layer is plain) are those of the same engine with the layers kept
    apart (JAXPAGE_CPU_STACKED_LAYERS=0) and the reference backend's tokens; a Gemma 2 keeps
    a dict a layer."""
    from jaxpage.layers import StackedLayers

    path, _ = hf_model_dir(family, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=96, num_hidden_layers=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    requests = mixed_requests(params, 37)
    kwargs = dict(block_size=8, num_blocks=48, max_num_batched_tokens=16, max_num_seqs=4,
                  enable_prefix_caching=True)

    stacked = LLM(path, attention_backend="cpp", **kwargs).engine
    assert isinstance(stacked.runner.params["layers"], StackedLayers)
    extras = {"llama": set(), "qwen2": {"qkv_bias"}, "qwen3": {"q_norm", "k_norm"}}[family]
    assert set(stacked.runner.params["layers"].arrays) == set(layers.FUSED_LAYER_PARAMS) | extras
    monkeypatch.setenv("JAXPAGE_CPU_STACKED_LAYERS", "0")
    apart = LLM(path, attention_backend="cpp", **kwargs).engine
    assert isinstance(apart.runner.params["layers"], list)
    ours = run_to_end(stacked, requests)
    assert all(len(tokens) == 6 for tokens in ours[0].values())
    assert ours == run_to_end(apart, requests)
    expected = mixed_workload(LLM(path, attention_backend="reference", **kwargs).engine,
                              requests)
    assert ours[0] == expected
    monkeypatch.delenv("JAXPAGE_CPU_STACKED_LAYERS")
    gemma2, _ = hf_model_dir("gemma2")
    assert isinstance(LLM(gemma2, num_blocks=8).engine.runner.params["layers"], list)
    # a subclass with a per-layer method of its own reads a dict a layer, unless it says
    # otherwise
    from jaxpage.models import gemma, llama, moe

    class OwnMlp(llama.LlamaModel):
        def _mlp(self, layer, h, live=None, **kwargs):
            return super()._mlp(layer, h, live, **kwargs)

    class OwnMlpStacked(OwnMlp):
        reads_stacked_layers = True

    config = stacked.model.config
    assert llama.LlamaModel(config).reads_stacked_layers
    assert not any(cls(config).reads_stacked_layers
                   for cls in (OwnMlp, gemma.GemmaModel, moe.MoeModel))
    assert OwnMlpStacked(config).reads_stacked_layers
    if family != "llama":
        return
    # a draft of the first layer runs on the target's stacks (`[:1]`, nothing copied): drafts
    # accepted and refused, the target's tokens
    spec = {"method": "draft_model", "model": "self", "draft_layers": 1,
            "num_speculative_tokens": 3, "adaptive": False}
    drafted = LLM(path, attention_backend="cpp", speculative_config=spec, **kwargs).engine
    draft_params = drafted.runner._draft.params
    assert isinstance(draft_params["layers"], StackedLayers)
    assert len(draft_params["layers"]) == 1
    assert draft_params["layers"].arrays is drafted.runner.params["layers"].arrays
    assert run_to_end(drafted, requests)[0] == expected
    spec_stats = drafted.stats()["spec_decode"]
    assert 0 < spec_stats["num_accepted_tokens"] < spec_stats["num_draft_tokens"], spec_stats


def _first_divergence(path, kwargs, prompts, tokens, expected) -> str:
    """Where the kernel's tokens first leave the reference's: the reference's top-2 logit
    margin at that step (its logits for the prompt plus the tokens both agreed on)."""
    lines = []
    reference = LLM(path, attention_backend="reference", **kwargs)
    for request_id, want in expected.items():
        got = tokens[request_id]
        step = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if step is None:
            continue
        prefix = prompts[request_id] + want[:step]
        out = reference.generate([prefix], SamplingParams(max_tokens=1, temperature=0,
                                                          logprobs=2, ignore_eos=True),
                                 use_tqdm=False)[0]
        top = sorted(out.outputs[0].logprobs[0].values())[-2:]  # logprob gaps = logit gaps
        lines.append(f"{request_id}: step {step} kernel {got[step]} reference {want[step]}, "
                     f"reference top-2 margin {top[1] - top[0]:.4f}")
    return "; ".join(lines)


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
        env={**os.environ, "JAXPAGE_CACHE": str(tmp_path), "JAXPAGE_CACHE_DIR": str(tmp_path),
             **env})  # JAXPAGE_CACHE_DIR, when set, wins over JAXPAGE_CACHE
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "jnp"
    if "CXX" in env:
        assert "CPU attention kernel unavailable" in result.stderr
