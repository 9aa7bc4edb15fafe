"""EngineConfig.kv_cache_dtype through the whole engine.

- The pool's size per byte: a quantized block costs head_dim bytes plus a 4-byte scale per KV
  head and token, so the same memory budget holds (D * 4) / (D + 4) times the float32 pool's
  blocks (hand-computed).
- Block sharing and recycling carry the scales with the values: the test_swap workload
  (greedy, n > 1 forks copying on write, beams, a shared prefix) on a quantized pool that
  preempts by recompute, with NaN refilled into every released block (NaN scales), produces
  the tokens of the same quantized engine on a pool big enough that nothing is preempted.
- Accuracy: on the tiny model, each 8-bit pool's top log-probs after 24 prompts within a
  stated bound of the float32 pool's; (slow, the default model) a held text read
  teacher-forced through a pool of each dtype, against a float32 pool
  (scripts/bench_kv_cache.py measures the same numbers).
- Bad values: an unknown dtype and a host pool for a quantized pool are refused by name.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from test_swap import SMALL, serve

from jaxpage import LLM, EngineConfig, SamplingParams
from jaxpage.attention import kv_bytes_per_block

QUANTIZED = ["int8", "float8_e4m3fn", "float8_e5m2"]


@pytest.fixture(scope="module")
def path(hf_model_dir):
    return hf_model_dir("llama")[0]


def test_a_block_costs_values_plus_one_scale_per_head_and_token():
    # 2 layers x (K, V) x 4 tokens x 2 heads x (8 values + a 4-byte scale)
    assert kv_bytes_per_block(2, 4, 2, 8, jnp.int8) == 2 * 2 * 4 * 2 * (8 + 4)
    assert kv_bytes_per_block(2, 4, 2, 8, jnp.float8_e4m3fn) == 2 * 2 * 4 * 2 * 12
    assert kv_bytes_per_block(2, 4, 2, 8, jnp.bfloat16) == 2 * 2 * 4 * 2 * 16
    assert kv_bytes_per_block(2, 4, 2, 8, jnp.float32) == 2 * 2 * 4 * 2 * 32


@pytest.mark.parametrize("kv_dtype,bytes_per_value", [("float32", 4), ("bfloat16", 2),
                                                      ("int8", 1), ("float8_e5m2", 1)])
def test_the_budget_holds_blocks_by_the_pool_dtype(path, kv_dtype, bytes_per_value):
    budget = 1 << 20
    llm = LLM(path, block_size=4, kv_cache_memory=budget, kv_cache_dtype=kv_dtype)
    config = llm.engine.runner.model.config  # tiny llama: 2 layers, 2 KV heads, head_dim 8
    row = config.head_dim * bytes_per_value + (4 if bytes_per_value == 1 else 0)
    block = 2 * config.num_layers * 4 * config.num_kv_heads * row
    assert llm.engine.runner.num_blocks == budget // block  # block 0 included (reserved)
    assert llm.stats()["kv_bytes_per_token"] == {"full_attention": block // 4}
    assert llm.stats()["kv_cache_dtype"] == kv_dtype


@pytest.fixture(scope="module")
def unpreempted(path):
    """The workload on big quantized pools, per format: nothing preempted."""
    runs = {}
    for fmt in QUANTIZED:
        llm = LLM(path, **{**SMALL, "num_blocks": 200}, kv_cache_dtype=fmt)
        runs[fmt] = serve(llm)
        assert llm.stats()["num_preemptions"] == 0
    return runs


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_forks_prefixes_and_preemption_keep_quantized_kv(path, unpreempted, fmt):
    llm = LLM(path, **SMALL, kv_cache_dtype=fmt)
    assert llm.engine.runner.kv_pool[0][0].dtype == jnp.dtype(fmt)
    assert serve(llm) == unpreempted[fmt]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the small pool should preempt"
    assert stats["prefix_cache_hits"] > 0


def test_backends_agree_on_a_quantized_pool(path, unpreempted):
    """The dense reference reads the int8 pool as the blockwise path does: same tokens."""
    llm = LLM(path, **{**SMALL, "num_blocks": 200}, kv_cache_dtype="int8",
              attention_backend="reference")
    assert serve(llm) == unpreempted["int8"]


# the largest |log-prob difference| from the float32 pool, over the top-20 tokens both report
# after each of 24 prompts (8-89 tokens, prefilled in chunks of 32 that read the earlier ones'
# K/V back from the pool): measured 0.00086 (int8), 0.0037 (e4m3), 0.0059 (e5m2) on the tiny
# random Llama, whose logits spread little; bounds about 3.5 times those
TINY_BOUNDS = {"int8": 0.003, "float8_e4m3fn": 0.012, "float8_e5m2": 0.02}


def test_quantized_pools_stay_close_to_float32_on_a_tiny_model(path):
    """Each 8-bit pool's top-20 log-probs after 24 prompts are the float32 pool's within its
    bound, and the finer the format, the closer on average (int8, then e4m3, then e5m2)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=int(n)).tolist() for n in rng.integers(8, 90, size=24)]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20, ignore_eos=True)

    def top(kv_dtype):  # each prompt's {token: log-prob} of its next token's top 20
        llm = LLM(path, block_size=4, num_blocks=700, max_num_batched_tokens=32,
                  max_num_seqs=24, kv_cache_dtype=kv_dtype)
        return [out.outputs[0].logprobs[0] for out in llm.generate(prompts, params,
                                                                    use_tqdm=False)]

    base, means = top("float32"), []
    for fmt, bound in TINY_BOUNDS.items():
        diffs = np.array([abs(ours[t] - theirs[t]) for ours, theirs in zip(top(fmt), base,
                                                                           strict=True)
                          for t in set(ours) & set(theirs)])
        assert len(diffs) >= 0.95 * 24 * 20, fmt  # nearly the same top 20
        assert diffs.max() <= bound, (fmt, diffs.max())
        means.append(diffs.mean())
    assert means == sorted(means), means


def test_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype.*'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")


def test_a_host_pool_is_refused_for_a_quantized_pool(path):
    with pytest.raises(ValueError, match="swap_space.*kv_cache_dtype='int8'"):
        LLM(path, block_size=4, num_blocks=20, swap_space=1 << 20, kv_cache_dtype="int8")


# measured by scripts/bench_kv_cache.py on the default model (float32 weights, 260 tokens,
# chunks of 128): bfloat16 0.0056 / 100%, int8 0.023 / 97.3%, float8_e4m3fn 0.064 / 95.4%,
# float8_e5m2 0.120 / 92.7%. Bounds about twice the mean and a few positions of agreement:
# int8 rounds each row to 1/254 of its range, e4m3 keeps 3 mantissa bits, e5m2 only 2.
BOUNDS = {"bfloat16": (0.015, 0.99), "int8": (0.05, 0.95), "float8_e4m3fn": (0.12, 0.92),
          "float8_e5m2": (0.25, 0.88)}


@pytest.mark.slow
def test_quantized_pools_stay_close_to_float32_on_a_held_text():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import bench_kv_cache

    llm = LLM(max_num_seqs=1)
    token_ids = llm.tokenizer.encode(bench_kv_cache.HELD_TEXT)
    rows = bench_kv_cache.accuracy(llm, token_ids, kv_dtypes=tuple(BOUNDS))
    for kv_dtype, (mean_bound, agreement_bound) in BOUNDS.items():
        row = rows[kv_dtype]
        assert row["mean_abs_logprob_diff"] < mean_bound, (kv_dtype, row)
        assert row["argmax_agreement"] >= agreement_bound, (kv_dtype, row)
    # finer formats are closer: int8's per-row scale beats e4m3's 3 mantissa bits beats e5m2
    means = [rows[k]["mean_abs_logprob_diff"] for k in ("bfloat16", "int8", "float8_e4m3fn",
                                                        "float8_e5m2")]
    assert means == sorted(means)
