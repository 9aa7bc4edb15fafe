"""Tensor parallelism on 8 virtual CPU devices (each case a subprocess: the device count is
fixed when JAX starts). The oracle is the same model on one device in the same process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")


def run_worker(*args: str) -> dict:
    proc = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_same_tokens(results: dict) -> None:
    single = results.pop("1")
    assert single["preemptions"] > 0 and single["hits"] > 0, "the workload must preempt and hit"
    for tp, result in results.items():
        assert result["tokens"] == single["tokens"], f"tp {tp} differs from one device"
        # decode steps ran ahead on the mesh as on one device (the token ids fed on every
        # device)
        assert (result["run_ahead"] > 0) == (single["run_ahead"] > 0), (tp, result["run_ahead"])
        assert (result["preemptions"], result["hits"]) == (single["preemptions"],
                                                           single["hits"])


@pytest.mark.parametrize("model, backend, sizes, preemption", [
    ("llama8", "cpp", "2,4,8", "recompute"),  # 8 query / 2 KV heads: replicated at 4 and 8
    # SmolLM2's 9 / 3 heads (slow: 31 s)
    pytest.param("smollm9", "cpp", "3", "recompute", marks=pytest.mark.slow),
    # the host pool holds every KV head of a block; with quantized pools: values and scales by
    # head (both in the slow suite, ~30 s: the default suite stays under 15 minutes)
    pytest.param("llama8", "cpp", "4", "swap", marks=pytest.mark.slow),
    # the jnp path sharded runs in the slow suite (20 s here; the default suite was at 15 min)
    pytest.param("llama8", "jnp", "4", "recompute", marks=pytest.mark.slow),
    # a window group beside the full one (slow: 37 s; the default suite passed 23 minutes on a
    # 2-core Zen 3)
    pytest.param("gemma2", "cpp", "2", "recompute", marks=pytest.mark.slow),
    pytest.param("llama8", "cpp", "4", "recompute:int8", marks=pytest.mark.slow),
    pytest.param("llama8", "jnp", "2,8", "recompute", marks=pytest.mark.slow),
    # tp 4 (KV heads replicated) only: every step interpreted, 8 minutes with tp 2 as well on a
    # 2-core Zen 3
    pytest.param("llama8", "pallas_tpu", "4", "recompute",
                 marks=[pytest.mark.slow, pytest.mark.kernels]),
    # mixtures of experts, 8 experts split over the devices (expert parallelism); Qwen3-MoE
    # with dense layers between its MoE ones (slow: ~40 s each)
    pytest.param("mixtral8", "cpp", "2,4", "recompute", marks=pytest.mark.slow),
    pytest.param("qwen3_moe8", "cpp", "2,4", "recompute", marks=pytest.mark.slow),
])
def test_tokens_equal_one_device(model, backend, sizes, preemption):
    """A mixed workload (chunked prefill, preemption, n=2 seeded samples, a prefix-cache
    hit, beam search) gives every token one device gives, with the same preemptions and
    hits (one block table serves every shard), decode steps running ahead on the mesh as on
    one device. "MODE:KV" also sets kv_cache_dtype."""
    results = run_worker("tokens", model, backend, sizes, *preemption.split(":"))
    if preemption == "swap":
        assert all(r["swapped"] > 0 for r in results.values())
    assert_same_tokens(results)


@pytest.mark.parametrize("proposer", ["known", pytest.param("draft", marks=pytest.mark.slow)])
def test_speculative_steps_on_the_mesh_equal_one_device(proposer):
    """Drafts verified on 2 devices: the tokens one device gives without speculation (greedy
    and seeded, a chunked prompt, preempting); the drafts a scripted proposer's, or a draft
    model's of its own split over the devices (its pool sharded as the target's)."""
    results = run_worker("speculative", "llama8", "2", proposer)
    plain = results.pop("plain")["tokens"]
    for tp, result in results.items():
        assert result["tokens"] == plain, f"tp {tp} with drafts differs"
        assert result["accepted"] > 10 and result["preemptions"] > 0, (tp, result)


def test_lora_adapters_on_the_mesh_equal_one_device():
    """Four PEFT adapters and base requests mixed in one batch, through 2 device slots, on a
    pool that preempts: at tp 2 and 4 (KV heads replicated: the adapters' k/v columns too)
    and over 2 data-parallel replicas, the tokens of one device, which differ from the base
    model's where an adapter runs."""
    results = run_worker("lora", "llama8", "2,4")
    base = results.pop("base")
    single = results.pop("1")
    assert single["preemptions"] > 0
    for tp, result in results.items():
        assert result["tokens"] == single["tokens"], f"tp {tp} differs from one device"
    assert [t == b for t, b in zip(single["tokens"], base, strict=True)] == [
        k % 5 == 4 for k in range(len(base))]


def test_each_device_holds_its_share():
    """From the arrays' addressable shards: each device holds 1/tp of the weights (the k/v
    projections times their replication when tp > KV heads) and of the pool, within 1%."""
    layers, h, q, k, i, v = 2, 256, 256, 64, 512, 128  # llama8_wide, float32
    kv_proj = layers * h * 2 * k * 4
    result = run_worker("memory", "llama8_wide", "2,4,8")
    single = result.pop("1")
    (weights,), (pool,) = single["params"], single["pool"]
    assert weights == 4 * (v * h * 2 + layers * (h * (q + 2 * k) + q * h + 3 * h * i + 2 * h)
                           + h)
    for tp, got in result.items():
        tp = int(tp)
        replicas = max(1, tp // 2)
        assert len(got["params"]) == len(got["pool"]) == tp
        want = (weights + (replicas - 1) * kv_proj) / tp
        assert all(abs(b - want) / want < 0.01 for b in got["params"]), (tp, got, want)
        assert got["pool"] == [pool * replicas // tp] * tp


@pytest.mark.parametrize("model, tp", [pytest.param("llama8", "2", marks=pytest.mark.slow),
                                       ("llama8", "8"), ("mixtral8", "2")])
def test_the_step_holds_the_designed_collectives_and_no_pool_copy(model, tp):
    """Per step: an all-reduce after each layer's o_proj and down_proj (a MoE layer's: after
    its experts, each device's own) plus one for the embedding, one all-gather of the
    logits, nothing else; the pool is donated (every buffer aliased to an output) and never
    copied."""
    result = run_worker("collectives", model, tp)
    layers = result.pop("num_layers")
    for step, ops in result.items():
        assert ops.pop("all-reduce") == 2 * layers + 1, step
        assert ops.pop("all-gather") == 1, step
        assert ops.pop("aliased_buffers") == 2 * layers, step
        assert all(count == 0 for count in ops.values()), (step, ops)


def test_data_parallel_replicas_serve_the_same_tokens_and_route_by_prefix():
    """data_parallel_size 2 x tensor_parallel_size 4 on 8 devices: every request gets the
    tokens one device gives; the prompt sharing a prefix with an earlier one goes to the
    replica that cached it and hits there; both replicas work, on disjoint devices."""
    result = run_worker("data_parallel", "llama8", "cpp", "2", "4")
    single, replicated = result["single"], result["replicated"]
    assert replicated["tokens"] == single["tokens"]
    # the prompt sharing PREFIX (5 blocks of 4) found them on the replica that cached them:
    # replica 1 (the first prompts alternate), where least-loaded routing would not send it
    assert replicated["again_cached"] == 20
    assert result["replica_hits"][1] >= 20
    assert sum(result["replica_hits"]) == replicated["hits"]
    assert all(steps > 0 for steps in result["replica_steps"])
    assert result["replica_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the totals' step phases: each replica's summed, adding up to the replicas' step seconds
    phases, per = result["phases"], result["replica_phases"]
    assert set(phases) == set(per[0]) and all(sum(p.values()) > 0 for p in per)
    for phase, seconds in phases.items():
        assert seconds == pytest.approx(sum(p[phase] for p in per), abs=1e-12)
    assert 0.99 * result["step_seconds"] <= sum(phases.values()) <= result["step_seconds"]


@pytest.mark.slow  # ~60 s; the default suite keeps to its 15 minutes
def test_data_parallel_replicas_of_a_sliding_window_model():
    """Gemma 2 (16-token windows on alternate layers: both KV groups per replica) as 2
    replicas of 2 devices: one device's tokens through preemption and prefix hits, and the
    prompt sharing a cached prefix routed to the replica holding it."""
    result = run_worker("data_parallel", "gemma2", "cpp", "2", "2")
    single, replicated = result["single"], result["replicated"]
    assert single["preemptions"] > 0 and single["hits"] > 0
    assert replicated["tokens"] == single["tokens"]
    assert replicated["again_cached"] == 20 and result["replica_hits"][1] >= 20


def test_bad_sizes_are_refused_naming_the_numbers():
    messages = run_worker("refusals")
    assert "data_parallel_size 3 x tensor_parallel_size 4 = 12 devices" in messages["dp3"]
    assert "16 exceeds the 8 devices" in messages["16"]
    for tp in ("3", "5"):
        assert f"tensor_parallel_size {tp} cannot split" in messages[tp]
        assert "num_heads 8" in messages[tp] and "valid sizes: [1, 2, 4, 8]" in messages[tp]


def test_the_sharded_decode_step_exports_for_tpu_at_llama3_8b_shapes():
    """No TPU here: `jax.export` lowers the tensor-parallel decode step for TPU on an
    abstract 8-device mesh at Llama-3-8B shapes (32 / 8 heads, head_dim 128, 8k context,
    bfloat16), with the Pallas TPU decode kernel (a Mosaic custom call) inside and the
    designed collectives per layer."""
    result = run_worker("export_tpu", "32")
    assert result["platforms"] == ["tpu"] and result["nr_devices"] == 8
    assert result["mosaic_calls"] >= 1
    assert result["all_reduces"] == 2 * result["num_layers"] + 1
    assert result["all_gathers"] == 1
