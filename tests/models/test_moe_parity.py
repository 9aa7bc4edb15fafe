"""Mixtral and Qwen3-MoE compute what HF transformers computes, through the paged KV pool,
and the grouped (ragged_dot) experts compute what running every expert does."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_greedy, hf_logits
from moe_models import MOE_CONFIGS, build_moe_model
from test_llama_parity import assert_prefill_then_decode_match, make_pool, paged_forward

from jaxpage import LLM, SamplingParams
from jaxpage.loading.checkpoint import load_checkpoint, save_checkpoint
from jaxpage.loading.gguf import load_gguf
from jaxpage.loading.hf import WeightsError, load_hf_dir
from jaxpage.models import build_model
from jaxpage.models.config import ModelConfig
from jaxpage.models.moe import (
    MoeModel,
    dense_experts,
    grouped_experts,
    route,
    tiled_experts,
    top_k,
)
from jaxpage.parallel import TensorParallel, valid_tp_sizes

ATOL = 1e-4


def test_config_from_hf(hf_model_dir):
    """Expert counts, widths, routing switches and the dense layers come from the HF config;
    num_params counts every expert, as HF's parameter count does (less q/k norms, which
    ModelConfig.num_params leaves out for every family)."""
    for name, expected_moe in [("mixtral", [True, True]), ("qwen3_moe", [True, True]),
                               ("qwen3_moe_sparse", [False, True, False, False])]:
        path, hf_model = hf_model_dir(name)
        config, _ = load_hf_dir(path, "float32")
        hf = hf_model.config
        assert config.num_experts == 8
        assert config.num_experts_per_tok == hf.num_experts_per_tok
        assert [config.is_moe_layer(n) for n in range(config.num_layers)] == expected_moe
        qk_norms = 2 * config.head_dim * config.num_layers if config.qk_norm else 0
        assert config.num_params + qk_norms == sum(p.numel() for p in hf_model.parameters())
    mixtral, _ = load_hf_dir(hf_model_dir("mixtral")[0], "float32")
    assert mixtral.moe_intermediate_size == 64 and mixtral.norm_topk_prob
    unnormed, _ = load_hf_dir(hf_model_dir("qwen3_moe_unnormed")[0], "float32")
    assert unnormed.moe_intermediate_size == 24 and not unnormed.norm_topk_prob


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_prompt_logits_match_hf(name, hf_model_dir):
    path, hf_model = hf_model_dir(name)
    config, params = load_hf_dir(path, "float32")
    model = build_model(config)
    assert isinstance(model, MoeModel)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, config.vocab_size, size=45).tolist()
    table = (rng.permutation(9)[:3] + 1).tolist()
    pool = make_pool(config, 10, 16)
    logits, _ = paged_forward(model, params, pool, table, 0, tokens, 16, all_logits=True)
    np.testing.assert_allclose(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_sparse"])
def test_token_by_token_decode_matches_hf(name, hf_model_dir):
    """Prefill a prompt that ends on a block boundary, then decode one token per step."""
    path, hf_model = hf_model_dir(name)
    config, params = load_hf_dir(path, "float32")
    model = build_model(config)
    rng = np.random.default_rng(2)
    block_size, prompt_len, total = 8, 8, 21
    tokens = rng.integers(0, config.vocab_size, size=total).tolist()
    table = [4, 1, 3]
    pool = make_pool(config, 6, block_size)
    assert_prefill_then_decode_match(model, params, pool, table, tokens, prompt_len,
                                     block_size, hf_logits(hf_model, tokens))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_unnormed"])
def test_engine_greedy_matches_hf_generate(name, hf_model_dir):
    """Through the whole engine (model built from the directory, batched, padded steps)."""
    path, hf_model = hf_model_dir(name)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (1, 7, 19)]
    llm = LLM(path, block_size=8, num_blocks=32, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 20)


# ----------------------------------------------------------------------------------------
# Grouped experts against every expert on every token


def expert_weights(num_experts, hidden, width, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(num_experts, hidden, 2 * width)) / hidden**0.5,
                        jnp.float32),
            jnp.asarray(rng.normal(size=(num_experts, width, hidden)) / width**0.5, jnp.float32))


def numpy_experts(h, weights, experts, gate_up, down) -> np.ndarray:
    """float64 oracle: for each token, its routed experts' MLPs, weighted and summed."""
    h, gate_up, down = (np.asarray(a, np.float64) for a in (h, gate_up, down))
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for w, e in zip(np.asarray(weights[t], np.float64), np.asarray(experts[t]), strict=True):
            gate, up = np.split(h[t] @ gate_up[e], 2)
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


GROUPED = jax.jit(grouped_experts)
DENSE = jax.jit(dense_experts)
TILED = jax.jit(tiled_experts, static_argnames="tile")


@pytest.mark.parametrize("num_tokens,num_experts,k", [(1, 8, 2), (13, 8, 3), (40, 16, 4)])
def test_grouped_experts_equal_dense_for_random_routing(num_tokens, num_experts, k):
    rng = np.random.default_rng(num_tokens)
    hidden, width = 32, 24
    gate_up, down = expert_weights(num_experts, hidden, width, seed=k)
    h = jnp.asarray(rng.normal(size=(num_tokens, hidden)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.permutation(num_experts)[:k] for _ in range(num_tokens)]),
                          jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), size=num_tokens), jnp.float32)
    oracle = numpy_experts(h, weights, experts, gate_up, down)
    np.testing.assert_allclose(GROUPED(h, weights, experts, gate_up, down), oracle, atol=1e-5)
    np.testing.assert_allclose(DENSE(h, weights, experts, gate_up, down), oracle, atol=1e-5)
    for tile in (1, 4, 8):
        np.testing.assert_allclose(TILED(h, weights, experts, gate_up, down, tile=tile), oracle,
                                   atol=1e-5, err_msg=f"tile {tile}")


def test_grouped_experts_with_idle_experts():
    """Routings that leave experts without tokens: empty groups first, last and between, and
    every token on one expert."""
    rng = np.random.default_rng(5)
    num_experts, hidden, width, num_tokens = 8, 32, 24, 11
    gate_up, down = expert_weights(num_experts, hidden, width, seed=0)
    h = jnp.asarray(rng.normal(size=(num_tokens, hidden)), jnp.float32)
    weights = jnp.asarray(rng.dirichlet(np.ones(2), size=num_tokens), jnp.float32)
    for used in ([3, 5], [1, 6], [0, 7], [2, 3, 4]):  # experts 0, 7, ... never chosen
        experts = np.stack([rng.permutation(used)[:2] for _ in range(num_tokens)])
        experts = jnp.asarray(experts, jnp.int32)
        oracle = numpy_experts(h, weights, experts, gate_up, down)
        np.testing.assert_allclose(GROUPED(h, weights, experts, gate_up, down), oracle,
                                   atol=1e-5, err_msg=f"experts {used}")
        np.testing.assert_allclose(TILED(h, weights, experts, gate_up, down), oracle,
                                   atol=1e-5, err_msg=f"experts {used}")
    one = jnp.full((num_tokens, 1), 4, jnp.int32)
    np.testing.assert_allclose(GROUPED(h, jnp.ones((num_tokens, 1)), one, gate_up, down),
                               numpy_experts(h, np.ones((num_tokens, 1)), one, gate_up, down),
                               atol=1e-5)


def test_routing_matches_hf_router_and_the_dense_model():
    """route() picks the experts HF's router module picks for the same inputs, each with
    HF's weight; and every expert run densely (dense_experts), combined with those weights,
    is HF's whole MoE block."""
    import torch

    hf_model = build_moe_model("qwen3_moe_unnormed")
    block = hf_model.model.layers[0].mlp
    h = torch.randn(64, 48)
    with torch.no_grad():
        _, hf_weights, hf_experts = block.gate(h)
        hf_out = block(h[None])[0].numpy()
    config = ModelConfig.from_hf(hf_model.config)
    weights, experts = route(config, jnp.asarray(h.numpy()),
                             jnp.asarray(block.gate.weight.detach().numpy().T))

    def by_expert(experts, weights):  # each token's (expert, weight) pairs, by expert id
        order = np.argsort(np.asarray(experts), -1)
        return (np.take_along_axis(np.asarray(experts), order, -1),
                np.take_along_axis(np.asarray(weights), order, -1))

    (ours_e, ours_w), (hf_e, hf_w) = by_expert(experts, weights), by_expert(hf_experts, hf_weights)
    np.testing.assert_array_equal(ours_e, hf_e)
    np.testing.assert_allclose(ours_w, hf_w, atol=1e-6)
    # HF's fused experts: gate_up [E, 2I, H], down [E, H, I]; ours [E, H, 2I], [E, I, H]
    gate_up, down = (jnp.asarray(p.detach().numpy().transpose(0, 2, 1))
                     for p in (block.experts.gate_up_proj, block.experts.down_proj))
    np.testing.assert_allclose(DENSE(jnp.asarray(h.numpy()), weights, experts, gate_up, down),
                               hf_out, atol=1e-5, rtol=0)


@pytest.mark.slow  # ~20 s: three models compiled; the grouped one is checked against HF by default
def test_dense_and_tiled_experts_models_equal_grouped(hf_model_dir):
    path, _ = hf_model_dir("qwen3_moe_sparse")
    config, params = load_hf_dir(path, "float32")
    tokens = list(range(3, 40))
    pool = make_pool(config, 4, 16, fill=0.0)
    grouped, _ = paged_forward(MoeModel(config, expert_fn=grouped_experts), params, pool,
                               [1, 2, 3], 0, tokens, 16, all_logits=True)
    for expert_fn in (dense_experts, tiled_experts, None):  # None: the platform's default
        other, _ = paged_forward(MoeModel(config, expert_fn=expert_fn), params, pool, [1, 2, 3],
                                 0, tokens, 16, all_logits=True)
        np.testing.assert_allclose(other, grouped, atol=1e-5, rtol=0, err_msg=str(expert_fn))


# ----------------------------------------------------------------------------------------
# Checkpoints


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_sparse"])
def test_checkpoint_round_trip(name, hf_model_dir, tmp_path):
    path, _ = hf_model_dir(name)
    config, params = load_hf_dir(path, "float32")
    save_checkpoint(str(tmp_path / "ckpt"), config, params)
    loaded_config, loaded, _ = load_checkpoint(str(tmp_path / "ckpt"), "float32")
    assert loaded_config == config
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------
# GGUF


def llama_cpp_tensors(path: str) -> dict[str, np.ndarray]:
    """An HF directory's tensors as convert_hf_to_gguf hands them to the name map: each MoE
    projection's experts stacked [E, ...] under the name without the expert index."""
    from safetensors import safe_open

    handle = safe_open(os.path.join(path, "model.safetensors"), framework="np")
    tensors, experts = {}, {}
    for name in handle.keys():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+\.weight)", name)
        if match:
            stack = experts.setdefault(f"{match[1]}.{match[3]}", {})
            stack[int(match[2])] = handle.get_tensor(name)
        else:
            tensors[name] = handle.get_tensor(name)
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return tensors


def write_moe_gguf(name, hf_model_dir, path, metadata=True):
    """The tiny model `name` as a GGUF written as llama.cpp writes it (Mixtral as "llama"
    with expert_count, its q/k rows permuted; Qwen3-MoE as "qwen3moe"); without `metadata`
    the expert counts are left out."""
    from loading.test_gguf_and_checkpoint import write_gguf

    model_dir, hf_model = hf_model_dir(name)
    hf = hf_model.config

    def experts(writer):
        if not metadata:
            return
        writer.add_expert_count(hf.num_experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
        if hf.model_type == "qwen3_moe":
            writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
            if not hf.norm_topk_prob:  # llama.cpp's default is to renormalize
                writer.add_expert_weights_norm(False)

    return write_gguf(hf_model, path, edit=experts, tensors=llama_cpp_tensors(model_dir))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_unnormed"])
def test_gguf_equals_its_hf_twin(name, hf_model_dir, tmp_path):
    file = write_moe_gguf(name, hf_model_dir, tmp_path / f"{name}.gguf")
    config, params = load_gguf(file, "float32")
    hf_config, hf_params = load_hf_dir(hf_model_dir(name)[0], "float32")
    assert config == hf_config
    assert jax.tree.structure(params) == jax.tree.structure(hf_params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gguf_without_expert_metadata_fails_clearly(hf_model_dir, tmp_path):
    file = write_moe_gguf("mixtral", hf_model_dir, tmp_path / "m.gguf", metadata=False)
    with pytest.raises(WeightsError, match="'blk.0.ffn_gate_inp.weight' is not part of a "
                                           "LlamaForCausalLM"):
        load_gguf(file, "float32")
    file = write_moe_gguf("qwen3_moe", hf_model_dir, tmp_path / "q.gguf", metadata=False)
    with pytest.raises(WeightsError, match="no 'qwen3moe.expert_count'"):
        load_gguf(file, "float32")


def test_tensor_parallel_splits_whole_experts(hf_model_dir):
    """Expert parallelism puts whole experts on each device: 8 experts split over 2 (the
    6 / 2 heads rule out 3 and 4), and 3 experts over 2 devices are refused, naming them."""
    config, _ = load_hf_dir(hf_model_dir("mixtral")[0], "float32")
    assert valid_tp_sizes(config, 4) == [1, 2]
    odd = dataclasses.replace(config, num_experts=3, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts 3 is not a multiple of it"):
        TensorParallel.create(odd, 2, jax.devices() * 2)


# ----------------------------------------------------------------------------------------
# Routing ties


def tie_rows(rng, num_rows, n):
    """Rows of n values from a few levels, many all equal: ties everywhere."""
    rows = (rng.integers(0, rng.integers(1, 5, size=(num_rows, 1)) + 1, size=(num_rows, n))
            / 7).astype(np.float32)
    rows[::5] = 0.25
    return rows


@pytest.mark.parametrize("n,k", [(4, 2), (8, 1), (8, 2), (8, 3), (9, 4), (16, 4), (64, 1),
                                 (64, 8), (128, 2), (128, 8)])
def test_torch_topk_port_picks_torch_sets(n, k):
    """The libstdc++ port picks torch.topk's CPU set on rows full of ties, in both of
    torch's regimes (nth_element; partial_sort when k * 64 <= n)."""
    import torch

    from jaxpage.models.torch_topk import torch_cpu_topk_indices

    rows = tie_rows(np.random.default_rng(n * k), 200, n)
    expected = np.sort(torch.topk(torch.from_numpy(rows), k).indices.numpy(), -1)
    got = np.array([torch_cpu_topk_indices(row, k) for row in rows])
    np.testing.assert_array_equal(got, expected)


def test_jitted_top_k_breaks_ties_as_torch():
    """Under jit, rows tied across the k-th place take torch's set (which here differs from
    jax.lax.top_k's lowest indices), and the other rows keep lax.top_k's."""
    import torch

    rng = np.random.default_rng(0)
    probs = np.concatenate([tie_rows(rng, 30, 8), rng.random((10, 8), np.float32)])
    values, indices = jax.jit(top_k, static_argnums=1)(jnp.asarray(probs), 3)
    expected = torch.topk(torch.from_numpy(probs), 3)
    np.testing.assert_array_equal(np.sort(indices, -1), np.sort(expected.indices.numpy(), -1))
    np.testing.assert_array_equal(np.sort(values, -1), np.sort(expected.values.numpy(), -1))
    lowest = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(probs), 3)[1]), -1)
    assert (lowest != np.sort(indices, -1)).any(axis=-1).sum() > 5


def test_tied_router_logits_match_hf(tmp_path):
    """A Qwen3-MoE (top 3) whose router rows come in identical pairs: every token's 3rd
    place is a tie between a pair's two experts, which HF breaks by torch.topk's rule."""
    import torch

    hf_model = build_moe_model("qwen3_moe")
    with torch.no_grad():
        for layer in hf_model.model.layers:
            router = layer.mlp.gate.weight
            router[1::2] = router[0::2]
    hf_model.save_pretrained(tmp_path)
    config, params = load_hf_dir(str(tmp_path), "float32")
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, size=30).tolist()
    logits, _ = paged_forward(build_model(config), params, make_pool(config, 3, 16), [1, 2],
                              0, tokens, 16, all_logits=True)
    np.testing.assert_allclose(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_bfloat16_close_to_float32(hf_model_dir):
    """bfloat16 params (router logits in bfloat16 tie far more often) stay close to float32."""
    path, _ = hf_model_dir("qwen3_moe")
    config, params32 = load_hf_dir(path, "float32")
    _, params16 = load_hf_dir(path, "bfloat16")
    model = build_model(config)
    tokens = list(range(3, 40))
    pool32 = make_pool(config, 4, 16, fill=0.0)
    pool16 = [(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)) for k, v in pool32]
    l32, _ = paged_forward(model, params32, pool32, [1, 2, 3], 0, tokens, 16, all_logits=True)
    l16, _ = paged_forward(model, params16, pool16, [1, 2, 3], 0, tokens, 16, all_logits=True)
    assert np.abs(l16 - l32).max() < 0.05 * np.abs(l32).max()
    assert (l16.argmax(-1) == l32.argmax(-1)).mean() > 0.9
