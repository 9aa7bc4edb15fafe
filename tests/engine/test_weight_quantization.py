"""EngineConfig.quantization through the whole engine.

- Accuracy: tiny random Llama, Qwen2 (q/k/v biases), Gemma 2 and Mixtral, quantized on load
  to int8 and fp8, read a fixed token sequence teacher-forced (every position's log-prob of
  the next token, through the paged pool as in serving) within a stated bound of their
  full-width selves, and pick the same argmax at most positions.
- Memory: llm.stats() counts the 8-bit projections at their values' and scales' bytes, about
  half their bfloat16 bytes.
- Tensor parallelism: an int8 model on 2 of 8 virtual CPU devices (scales split with their
  columns, kept whole for row-split weights, by expert for MoE stacks) gives one device's
  tokens.
- The CPU's one-call decoder layer takes int8 weights packed for its kernel (and declines fp8
  and unpacked ones), giving what XLA's dot over the int8 weights gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpage import LLM, SamplingParams
from jaxpage.layers import quantized_linear as ql

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_kv_cache import score_text  # noqa: E402

# a fixed sequence over the tiny models' 97-token vocabulary, read teacher-forced in one chunk
TEXT = np.random.default_rng(7).integers(3, 97, size=96).tolist()
# per family and format: the largest |log-prob difference| from the same model at full width
# (float32) over the 95 positions, and the share of positions whose argmax (the greedy token)
# agrees. Measured: Llama int8 0.0020 / 100%, fp8 0.0058 / 98.9%; Qwen2 int8 0.0019 / 100%,
# fp8 0.010 / 100%; Gemma 2 int8 0.033 / 94.7%, fp8 0.15 / 86.3% (its tiny random logits
# spread 5x the others', and it norms each sublayer's output again); Mixtral int8 0.0010 /
# 98.9%, fp8 0.0072 / 97.9%. Bounds about 3x the difference, a few positions below the
# agreement.
BOUNDS = {
    "llama": {"int8": (0.006, 0.97), "fp8": (0.02, 0.95)},
    "qwen2": {"int8": (0.006, 0.97), "fp8": (0.03, 0.95)},
    "gemma2": {"int8": (0.1, 0.9), "fp8": (0.45, 0.8)},
    "mixtral": {"int8": (0.003, 0.96), "fp8": (0.025, 0.94)},
}


def engine(path: str, quantization=None, dtype="float32") -> LLM:
    return LLM(path, quantization=quantization, dtype=dtype, block_size=4, num_blocks=64,
               max_num_seqs=4, max_num_batched_tokens=64)


@pytest.mark.parametrize("family", [
    "llama",
    # ~8 s each on a shared 2-core machine: the slow suite
    pytest.param("qwen2", marks=pytest.mark.slow),
    pytest.param("gemma2", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
])
def test_quantized_models_stay_close_to_full_width(hf_model_dir, family):
    """Each format within its bound of full width, and int8 (1/254 of a column's range a
    step) closer on average than fp8 (3 mantissa bits)."""
    path = hf_model_dir(family)[0]

    def score(llm):
        return score_text(llm, TEXT, "float32", chunk=len(TEXT), block_size=4)

    base_lp, base_arg = score(engine(path))
    means = []
    for fmt, (bound, agreement) in BOUNDS[family].items():
        llm = engine(path, fmt)
        layer = llm.engine.runner.params["layers"][0]
        assert isinstance(layer["o"], ql.QuantizedWeight) and layer["o"].format == fmt
        lp, arg = score(llm)
        diff = np.abs(lp - base_lp)
        assert 0 < diff.max() <= bound, (family, fmt, diff.max())
        assert (arg == base_arg).mean() >= agreement, (family, fmt, (arg == base_arg).mean())
        means.append(diff.mean())
    assert means[0] < means[1], means


def test_stats_count_int8_projections_at_half_their_bfloat16_bytes(hf_model_dir):
    path = hf_model_dir("llama")[0]
    full = engine(path, dtype="bfloat16").stats()
    int8 = engine(path, "int8", dtype="bfloat16").stats()
    assert full["quantization"] is None and full["quantized_weight_bytes"] == 0
    assert int8["quantization"] == "int8"
    # what stayed bfloat16 (embedding, norms, lm head) weighs the same in both
    rest = int8["weight_bytes"] - int8["quantized_weight_bytes"]
    projections_bf16 = full["weight_bytes"] - rest
    ratio = int8["quantized_weight_bytes"] / projections_bf16
    # int8 values at half the bytes, plus a 4-byte scale a column: (K + 4) / 2K with the
    # tiny model's K = 48 or 64 in
    assert 0.5 < ratio < 0.55, ratio


def test_the_fused_cpu_layer_takes_packed_int8_weights(hf_model_dir, monkeypatch):
    """SmolLM2-shaped (SiLU, no biases, every projection's columns a multiple of the
    kernel's panel width): the fused CPU layer takes the layer at full width and with int8
    weights packed for the kernel, declines fp8 and unpacked int8; decoding through it gives
    the tokens and, to float32 rounding, the log-probs of int8 through XLA's dot."""
    import jax.numpy as jnp

    from jaxpage import layers
    from jaxpage.attention import build_metadata
    from pallas_kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the CPU kernel library is not built here")
    path = hf_model_dir("smollm2", hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96)[0]

    def fusable(llm) -> bool:
        runner = llm.engine.runner
        config = runner.model.config
        layer = runner.params["layers"][0]
        _, md = build_metadata([[1]], [0], [1], 4, backend=runner.backend)
        x = jnp.zeros((1, config.hidden_size), jnp.float32)
        return layers.fusable(layer, runner.kv_pool[0], layer["mlp_norm"], x, md,
                              config.head_dim)

    def decode(llm):
        out = llm.generate([TEXT[:9], TEXT[20:23]], SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
        return ([c.token_ids for o in out for c in o.outputs],
                np.array([lp[t] for o in out for c in o.outputs
                          for lp, t in zip(c.logprobs, c.token_ids, strict=True)]))

    assert fusable(engine(path))  # the control: the full-width layer is taken
    int8 = engine(path, "int8")
    assert int8.engine.runner.params["layers"][0]["o"].packed and fusable(int8)
    assert not fusable(engine(path, "fp8"))
    monkeypatch.setenv("JAXPAGE_CPU_PACKED_WEIGHTS", "0")
    xla = engine(path, "int8")
    assert not fusable(xla)
    (tokens, lps), (want_tokens, want_lps) = decode(int8), decode(xla)
    assert tokens == want_tokens
    np.testing.assert_allclose(lps, want_lps, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # a tied head, an untied one
def test_quantize_lm_head(hf_model_dir, family):
    """quantize_lm_head: the head in int8 a scale per vocabulary entry, a tied one read back
    as the embedding; within the int8 bound of full width, a little further than the
    projections alone; a packable tied head packed for the kernel. Refused without
    quantization."""
    import jax.numpy as jnp

    from jaxpage import layers

    path = hf_model_dir(family)[0]

    def score(llm):
        return score_text(llm, TEXT, "float32", chunk=len(TEXT), block_size=4)

    base_lp, _ = score(engine(path))
    proj_lp, _ = score(engine(path, "int8"))
    llm = LLM(path, quantization="int8", quantize_lm_head=True, block_size=4, num_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=64)
    params = llm.engine.runner.params
    head = params["lm_head" if "lm_head" in params else "embed"]
    assert ql.is_quantized(head) and head.format == "int8"
    lp, arg = score(llm)
    diff = np.abs(lp - base_lp)
    assert 0 < diff.max() <= BOUNDS[family]["int8"][0] * 2, diff.max()
    assert diff.mean() > np.abs(proj_lp - base_lp).mean()
    if "embed" in params:  # tied: its rows are the head's columns, scaled
        assert not head.packed  # 97 columns: no panel width divides them
        rows = layers.embed(head, jnp.arange(97), head.values.shape[0], dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(head.values, np.float32).T
                                      * np.asarray(head.scale)[:, None])
    with pytest.raises(ValueError, match="quantize_lm_head"):
        LLM(path, quantize_lm_head=True)


def test_a_quantized_tied_head_packs_and_reads_its_rows(hf_model_dir):
    """A SmolLM2-shaped tied head, int8 and packed for the kernel: each embedding row read out
    of the panels is values[:, v] * scale[v] of the unpacked weight, and decoding gives the
    tokens and log-probs (1e-4) of the same model on XLA's path (unpacked)."""
    import jax.numpy as jnp

    from jaxpage import layers
    from pallas_kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the CPU kernel library is not built here")
    path = hf_model_dir("smollm2", hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96, vocab_size=128)[0]
    packed = LLM(path, quantization="int8", quantize_lm_head=True, block_size=4,
                 num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    head = packed.engine.runner.params["embed"]
    assert ql.is_quantized(head) and head.packed
    values = np.asarray(cpu_ops.unpack_weight_int8(head.values, 64), np.float32)
    ids = jnp.arange(head.scale.shape[0])
    rows = np.asarray(layers.embed(head, ids, 64, dtype=jnp.float32))
    np.testing.assert_array_equal(rows, values.T * np.asarray(head.scale)[:, None])

    def decode(llm):
        out = llm.generate([TEXT[:9]], SamplingParams(
            max_tokens=10, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
        c = out[0].outputs[0]
        return c.token_ids, np.array([lp[t] for lp, t in zip(c.logprobs, c.token_ids,
                                                              strict=True)])

    tokens, lps = decode(packed)
    os.environ["JAXPAGE_CPU_PACKED_WEIGHTS"] = "0"
    try:
        xla = LLM(path, quantization="int8", quantize_lm_head=True, block_size=4,
                  num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    finally:
        del os.environ["JAXPAGE_CPU_PACKED_WEIGHTS"]
    assert not xla.engine.runner.params["embed"].packed
    want_tokens, want_lps = decode(xla)
    assert tokens == want_tokens
    np.testing.assert_allclose(lps, want_lps, atol=1e-4)


TP_SCRIPT = r"""
import json, os, sys, tempfile
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, sys.argv[1])
from conftest import build_tiny_model
from jaxpage import LLM, SamplingParams
name, fmt, head = sys.argv[2], sys.argv[3], sys.argv[4] == "head"
path = tempfile.mkdtemp()
build_tiny_model(name, 0, num_attention_heads=8, num_key_value_heads=2).save_pretrained(path)
prompts = [list(range(3, 40)), [5, 9, 11], list(range(60, 90, 2))]
greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
out = {}
for tp in (1, 2):
    llm = LLM(path, quantization=fmt, quantize_lm_head=head, tensor_parallel_size=tp,
              block_size=4, num_blocks=64, max_num_batched_tokens=16)
    out[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    params = llm.engine.runner.params
    layer = params["layers"][0]
    w = layer["experts_down"] if "experts_down" in layer else layer["qkv"]
    if head:  # the head's scales (a tied head: the embedding's)
        w = params["lm_head" if "lm_head" in params else "embed"]
        out["tied"] = "lm_head" not in params
    out[f"{tp}_scale_shards"] = sorted({tuple(s.data.shape) for s in w.scale.addressable_shards})
print(json.dumps(out))
"""


# a subprocess of two engines (15 s and 22 s on a shared 2-core machine): the slow suite
@pytest.mark.slow
@pytest.mark.parametrize("name,fmt,head", [
    ("llama", "int8", ""), ("mixtral", "fp8", ""),
    # quantize_lm_head: a tied head (the embedding, looked up on its devices) and an untied one
    ("llama", "int8", "head"), ("qwen2", "fp8", "head")])
def test_tensor_parallel_quantized_model_gives_one_devices_tokens(name, fmt, head):
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT, tests, name, fmt, head],
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.join(tests, ".."))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["2"] == out["1"]
    if head:
        assert out["tied"] == (name == "qwen2")
    # the scales were split over the 2 devices: qkv's or the head's columns (the vocabulary
    # padded to a multiple of 2), or the experts
    one, two = out["1_scale_shards"], out["2_scale_shards"]
    assert len(one) == len(two) == 1 and two[0][0] == -(-one[0][0] // 2), (one, two)
