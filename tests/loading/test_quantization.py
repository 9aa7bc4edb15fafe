"""8-bit weights (jaxpage.layers.quantized_linear, jaxpage.loading.quantization).

- The rule and the matmuls against float64 NumPy: quantize's scale is the column's max |w|
  over 127 / 448 and each element within its stated error bound; XLA's int8 / fp8 matmul, a
  MoE layer's per-expert forms (one expert, ragged groups, every expert) equal x @ (values *
  scale) computed in float64, to float32 accumulation error.
- Lowered for CUDA and TPU (jax.export), the weight enters the program in 8 bits and its only
  use is the widening that feeds the dot: no full-width copy of it is an output of anything
  else.
- A compressed-tensors checkpoint written here as llm-compressor writes one (int8 and fp8,
  channel and tensor strategies) loads as stored, equal bit for bit to the same full-width
  checkpoint quantized on load by the same rule; refusals name their field.
- A GGUF Q8_0 file loads as int8: its values requantized per column from the exact Q8_0
  weights, within max |w[:, n]| / 254 of them.
"""

from __future__ import annotations

import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_hf_model

from jaxpage.layers import quantized_linear as ql
from jaxpage.loading import load_model
from jaxpage.loading import quantization as quant

RNG = np.random.default_rng(0)


def oracle(x, w: ql.QuantizedWeight) -> np.ndarray:
    """x @ (values * scale) in float64."""
    full = np.asarray(w.values, np.float64) * np.asarray(w.scale, np.float64)[..., None, :]
    return np.asarray(x, np.float64) @ full


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_rule_scales_each_column_by_its_largest_magnitude(fmt):
    w = (RNG.standard_normal((96, 40)) * RNG.uniform(0.01, 3, 40)).astype(np.float32)
    w[:, 7] = 0  # a column of zeros
    q = ql.quantize(w, fmt)
    assert q.values.dtype == ql.VALUE_DTYPES[fmt] and q.scale.dtype == np.float32
    top = {"int8": 127, "fp8": 448}[fmt]
    amax = np.abs(w).max(axis=0)
    expected = np.where(amax > 0, amax / np.float32(top), 1).astype(np.float32)
    np.testing.assert_array_equal(q.scale, expected)
    values = np.asarray(q.values, np.float64)
    assert np.abs(values).max() == top  # each nonzero column reaches the format's top
    err = np.abs(values * q.scale - w)
    if fmt == "int8":  # half a step: max |w[:, n]| / 254
        assert np.all(err <= q.scale / 2 * (1 + 1e-6))
    else:  # half a float8 step: 2^-4 relative, or 2^-10 * scale among the subnormals
        assert np.all(err <= np.maximum(np.abs(w) / 16, q.scale / 1024) * (1 + 1e-6))
    assert np.all(values[:, 7] == 0)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_matmul_is_x_times_the_dequantized_weight(fmt, dtype):
    w = ql.quantize(RNG.standard_normal((80, 48)), fmt)
    x = jnp.asarray(RNG.standard_normal((5, 80)), dtype)
    got = jax.jit(ql.matmul_f32)(x, w)
    assert got.dtype == jnp.float32
    want = oracle(np.asarray(x.astype(jnp.float32)), w)  # x as the matmul sees it
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    # the engine's entry takes it the same way
    from jaxpage import layers

    np.testing.assert_array_equal(np.asarray(jax.jit(layers.matmul_f32)(x, w)),
                                  np.asarray(got))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_expert_matmuls_scale_by_each_experts_columns(fmt):
    e, k, n, t = 4, 32, 24, 9
    w = ql.quantize(RNG.standard_normal((e, k, n)) * RNG.uniform(0.1, 2, (e, 1, n)), fmt)
    assert w.scale.shape == (e, n)
    x = RNG.standard_normal((t, k)).astype(np.float32)
    per_expert = np.stack([oracle(x, w[i]) for i in range(e)])  # [E, T, N]
    # one expert
    got = jax.jit(ql.expert_matmul)(jnp.asarray(x), w, 2)
    np.testing.assert_allclose(np.asarray(got), per_expert[2], rtol=1e-5, atol=1e-4)
    # ragged groups: rows 0-2 expert 0, 3-3 expert 1, 4-8 expert 3
    sizes = np.array([3, 1, 0, 5], np.int32)
    row_expert = np.repeat(np.arange(e), sizes)
    got = jax.jit(ql.ragged_matmul)(jnp.asarray(x), w, jnp.asarray(sizes),
                                    jnp.asarray(row_expert))
    np.testing.assert_allclose(np.asarray(got), per_expert[row_expert, np.arange(t)],
                               rtol=1e-5, atol=1e-4)
    # every expert on every token
    got = jax.jit(ql.expert_einsum, static_argnums=0)("th,ehi->eti", jnp.asarray(x), w)
    np.testing.assert_allclose(np.asarray(got), per_expert, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_accelerators_get_the_weight_in_8_bits_widened_only_for_the_dot(platform, fmt):
    """The program jax.export lowers for the platform takes the values in 8 bits, and the
    widened values feed the dot and nothing else (the compiler then fuses the widening into
    the matmul; a widened copy used elsewhere would have to be kept whole)."""
    w = ql.quantize(RNG.standard_normal((256, 128)), fmt)
    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)

    def step(x, w):
        return ql.matmul_f32(x, w).astype(x.dtype)

    exported = jax.export.export(jax.jit(step), platforms=[platform])(x, w)
    text = exported.mlir_module()
    small = {"int8": "i8", "fp8": "f8E4M3FN"}[fmt]
    assert re.search(rf"%arg1: tensor<256x128x{small}>", text), text[:2000]
    widened = re.findall(rf"(%\S+) = stablehlo.convert %arg1 : \(tensor<256x128x{small}>\)",
                         text)
    assert len(widened) == 1, text
    uses = [line for line in text.splitlines() if re.search(rf"{re.escape(widened[0])}\b", line)
            and "stablehlo.convert %arg1" not in line]
    assert len(uses) == 1 and "dot_general" in uses[0], uses


# ----------------------------------------------------------------------------------------
# compressed-tensors checkpoints


def compressed_tensors_config(kind: str, strategy: str = "channel", activations=None,
                              **weights) -> dict:
    """config.json's quantization_config as llm-compressor writes it for a W8A16 (or, with
    `activations`, W8A8) scheme of `kind` "int" / "float"."""
    return {
        "quant_method": "compressed-tensors",
        "format": {"int": "int-quantized", "float": "float-quantized"}[kind],
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy,
                        "dynamic": False, "group_size": None, "block_structure": None,
                        "actorder": None, "observer": "minmax", "observer_kwargs": {},
                        **weights},
            "input_activations": activations,
            "output_activations": None,
        }},
    }


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_compressed_tensors(src: str, dst: str, fmt: str, strategy: str = "channel",
                             **config_kwargs) -> None:
    """The HF checkpoint at `src` rewritten as a compressed-tensors one: every projection's
    `weight` [out, in] in 8 bits by jaxpage's rule (per output channel; with strategy
    "tensor", one scale for the whole tensor) and its `weight_scale` [out, 1] / [1] float32;
    the rest (embedding, norms, lm_head: ignored) as it was."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            if strategy == "tensor":  # one column's quantization of the whole tensor
                flat = ql.quantize(t.reshape(-1, 1), fmt)
                values, scale = flat.values.reshape(t.shape), flat.scale.reshape(1)
            else:
                q = ql.quantize(t.T, fmt)  # [in, out]: a scale per output channel
                values, scale = q.values.T, q.scale[:, None]
            out[name] = np.ascontiguousarray(values)
            out[name.removesuffix("weight") + "weight_scale"] = scale.astype(np.float32)
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = compressed_tensors_config(
        {"int8": "int", "fp8": "float"}[fmt], strategy, **config_kwargs)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def leaves(params):
    return jax.tree_util.tree_leaves_with_path(params)


@pytest.fixture(scope="module")
def llama_dir(hf_model_dir):
    return hf_model_dir("llama")[0]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_compressed_tensors_checkpoint_is_quantize_on_load_bit_for_bit(llama_dir, fmt,
                                                                         tmp_path):
    stored = str(tmp_path / "ct")
    write_compressed_tensors(llama_dir, stored, fmt)
    _, on_load, _ = load_model(llama_dir, "bfloat16", quantization=fmt)
    _, as_stored, _ = load_model(stored, "bfloat16")  # the config says what it is
    assert jax.tree.structure(as_stored) == jax.tree.structure(on_load)
    for (path, a), (_, b) in zip(leaves(as_stored), leaves(on_load), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)), path
    layer = as_stored["layers"][0]
    assert all(isinstance(layer[n], ql.QuantizedWeight) and layer[n].format == fmt
               for n in ("qkv", "o", "gate_up", "down"))
    assert not isinstance(as_stored["lm_head"], ql.QuantizedWeight)
    # asking for the format it is stored in is the same load; another one is refused
    _, again, _ = load_model(stored, "bfloat16", quantization=fmt)
    assert np.array_equal(again["layers"][1]["down"].values, as_stored["layers"][1]["down"].values)
    other = {"int8": "fp8", "fp8": "int8"}[fmt]
    with pytest.raises(ValueError, match=f"quantization '{other}'.*stored quantized as {fmt}"):
        load_model(stored, "bfloat16", quantization=other)


def test_a_per_tensor_fp8_scale_scales_every_column(llama_dir, tmp_path):
    stored = str(tmp_path / "ct")
    write_compressed_tensors(llama_dir, stored, "fp8", strategy="tensor")
    from safetensors.numpy import load_file

    raw = load_file(os.path.join(llama_dir, "model.safetensors"))
    _, params, _ = load_model(stored, "float32")
    qkv = params["layers"][1]["qkv"]
    h = raw["model.layers.1.self_attn.q_proj.weight"].shape[0]
    # q's columns share q_proj's one scale, k's k_proj's
    assert len(set(qkv.scale[:h].tolist())) == 1
    full = np.concatenate([raw[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]).T
    dequantized = ql.dequantize(qkv)
    assert np.all(np.abs(dequantized - full) <= np.maximum(np.abs(full) / 16,
                                                            qkv.scale / 1024) * (1 + 1e-6))


def test_activation_quantized_schemes_load_weight_only_with_a_log_line(llama_dir, tmp_path,
                                                                       caplog):
    stored = str(tmp_path / "w8a8")
    write_compressed_tensors(llama_dir, stored, "int8", activations={
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True})
    with caplog.at_level(logging.WARNING, logger="jaxpage.loading"):
        _, params, _ = load_model(stored, "float32")
    assert "weight-only" in caplog.text
    assert params["layers"][0]["o"].format == "int8"


@pytest.mark.parametrize("change,field", [
    ({"num_bits": 4}, "num_bits"), ({"symmetric": False}, "symmetric"),
    ({"strategy": "group", "group_size": 128}, "strategy"), ({"dynamic": True}, "dynamic")])
def test_unsupported_schemes_are_refused_by_field(llama_dir, tmp_path, change, field):
    stored = str(tmp_path / "ct")
    write_compressed_tensors(llama_dir, stored, "int8", **change)
    with pytest.raises(ValueError, match=rf"weights\.{field}"):
        load_model(stored, "float32")


def test_other_quant_methods_and_formats_are_refused():
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        quant.stored_quantization({"quantization_config": {"quant_method": "gptq"}})
    config = compressed_tensors_config("int")
    config["format"] = "pack-quantized"
    with pytest.raises(ValueError, match="format 'pack-quantized'"):
        quant.stored_quantization({"quantization_config": config})
    assert quant.stored_quantization({}) is None
    assert quant.stored_quantization({"quantization_config": compressed_tensors_config(
        "float")}) == "fp8"


def test_a_missing_scale_is_named(llama_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    stored = str(tmp_path / "ct")
    write_compressed_tensors(llama_dir, stored, "int8")
    file = os.path.join(stored, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, file)
    with pytest.raises(Exception, match="model.layers.1.mlp.down_proj.weight_scale"):
        load_model(stored, "float32")


def test_engine_config_and_the_loader_agree_on_the_formats():
    from jaxpage.config import QUANTIZATIONS, EngineConfig

    assert QUANTIZATIONS == ql.QUANTIZATIONS
    with pytest.raises(ValueError, match="quantization.*'int4'"):
        EngineConfig(quantization="int4")


# ----------------------------------------------------------------------------------------
# GGUF Q8_0


def test_a_q8_0_gguf_loads_as_int8_within_half_a_column_step(tmp_path):
    gguf = pytest.importorskip("gguf")
    from test_gguf_and_checkpoint import write_gguf

    hf = build_hf_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96)
    file = write_gguf(hf, tmp_path / "q.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    _, full, _ = load_model(file, "float32", cache_gguf=False)  # Q8_0 dequantized, exact
    _, int8, _ = load_model(file, "bfloat16", cache_gguf=False, quantization="int8")
    for a, b in zip(full["layers"], int8["layers"], strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            w, q = a[name], b[name]
            assert q.format == "int8" and q.values.shape == w.shape
            # the rule applied to the exact Q8_0 weights (float16 scale x int8 is a float32)
            requantized = ql.quantize(w, "int8")
            assert np.array_equal(q.values, requantized.values)
            assert np.array_equal(q.scale, requantized.scale)
            assert np.all(np.abs(ql.dequantize(q) - w)
                          <= np.abs(w).max(axis=0) / 254 * (1 + 1e-6))
        assert b["attn_norm"].dtype == jnp.bfloat16
    assert int8["embed"].dtype == jnp.bfloat16  # the embedding stays full width
