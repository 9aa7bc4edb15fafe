"""HF-named tensors -> each model family's params layout.

A loader reads tensors under their HF names (a safetensors directory, `jaxpage.loading.hf`;
a GGUF file renamed to them, `jaxpage.loading.gguf`) and hands a getter to
`params_from_hf_tensors`, which calls the config's family's converter (`CONVERTERS`, keyed
like `jaxpage.models.FAMILIES`): it fetches each tensor, checks its shape against the config,
transposes nn.Linear's [out, in] to jaxpage's [in, out] and fuses q/k/v and gate/up as the
family's params layout has them. The model families know no file format.

The decoder's projections are read through `linear(..., projection=True)`: an 8-bit tensor of
a compressed-tensors checkpoint (with its `weight_scale`) becomes a `layers.QuantizedWeight`
as stored, and with a `quantization` asked for a full-width one is quantized as it is read
(`jaxpage.loading.quantization`). Every other nn.Linear (a MoE router, the LM head) is full
width, dequantized if the checkpoint stored it in 8 bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.layers import quantized_linear
from jaxpage.loading import quantization as quant
from jaxpage.loading.errors import WeightsError
from jaxpage.models import FAMILIES
from jaxpage.models.config import ModelConfig

# Returns the HF-layout tensor (nn.Linear weights are [out, in]) or None when absent.
TensorGetter = Callable[[str], "np.ndarray | None"]


def hf_fetchers(config: ModelConfig, get: TensorGetter, quantization: str | None = None):
    """(fetch(name, shape), linear(name, in_dim, out_dim, projection=False)): HF tensors
    checked against the shape the config expects (naming the first one missing or of the
    wrong shape); `linear` also transposes nn.Linear's [out, in] to jaxpage's [in, out]. A
    `projection` (a decoder projection's weight) comes as stored when stored in 8 bits, else
    quantized to `quantization` when one is given; any other weight stored in 8 bits is
    dequantized to float32 (module doc)."""

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        tensor = get(name)
        if tensor is None:
            raise WeightsError(f"weights have no tensor {name!r} (config: {config.architecture})")
        if tuple(tensor.shape) != tuple(shape):
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, but the config expects "
                f"{tuple(shape)}"
            )
        return np.asarray(tensor)

    def linear(name: str, in_dim: int, out_dim: int, projection: bool = False) -> Any:
        tensor = fetch(name, (out_dim, in_dim))
        if quant.is_stored_quantized(tensor):
            scale_name = name.removesuffix("weight") + "weight_scale"
            w = quant.stored_weight(tensor, get(scale_name), name)
            return w if projection else quantized_linear.dequantize(w)
        if projection and quantization is not None:
            return quantized_linear.quantize(tensor.T, quantization)
        return tensor.T  # nn.Linear [out, in] -> [in, out]

    return fetch, linear


def attention_params(config: ModelConfig, fetch, linear, prefix: str) -> dict[str, np.ndarray]:
    """One layer's attention params (fused qkv, o, the config's biases and q/k norms) from
    the HF tensors under `prefix` ("model.layers.N."), through `hf_fetchers`' helpers."""
    h, d, q, kv = config.hidden_size, config.head_dim, config.q_size, config.kv_size
    p = prefix + "self_attn."
    params = {
        "qkv": quant.join_columns([linear(p + "q_proj.weight", h, q, projection=True),
                                   linear(p + "k_proj.weight", h, kv, projection=True),
                                   linear(p + "v_proj.weight", h, kv, projection=True)]),
        "o": linear(p + "o_proj.weight", q, h, projection=True),
    }
    if config.qkv_bias:
        params["qkv_bias"] = np.concatenate([fetch(p + "q_proj.bias", (q,)),
                                             fetch(p + "k_proj.bias", (kv,)),
                                             fetch(p + "v_proj.bias", (kv,))])
    if config.o_bias:
        params["o_bias"] = fetch(p + "o_proj.bias", (h,))
    if config.qk_norm:
        params["q_norm"] = fetch(p + "q_norm.weight", (d,))
        params["k_norm"] = fetch(p + "k_norm.weight", (d,))
    return params


def attention_from_hf(config: ModelConfig, fetch, linear, n: int) -> dict[str, np.ndarray]:
    """Layer `n`'s attention and both its norms in the Llama-family params layout (every
    family whose HF attention and norms are Llama's shares it)."""
    p = f"model.layers.{n}."
    h = config.hidden_size
    return {"attn_norm": fetch(p + "input_layernorm.weight", (h,)),
            **attention_params(config, fetch, linear, p),
            "mlp_norm": fetch(p + "post_attention_layernorm.weight", (h,))}


def mlp_from_hf(config: ModelConfig, fetch, linear, prefix: str, width: int,
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                ) -> dict[str, np.ndarray]:
    """The gated MLP under `prefix` ("model.layers.3.mlp.", or one expert's) of width
    `width`: {"gate_up": [H, 2I], "down": [I, H]}, plus biases when config.mlp_bias.
    `names` are its gate, up and down projections' HF names."""
    h = config.hidden_size
    gate, up, down = (prefix + name for name in names)
    mlp = {"gate_up": quant.join_columns([linear(gate + ".weight", h, width, projection=True),
                                          linear(up + ".weight", h, width, projection=True)]),
           "down": linear(down + ".weight", width, h, projection=True)}
    if config.mlp_bias:
        mlp["gate_up_bias"] = np.concatenate([fetch(gate + ".bias", (width,)),
                                              fetch(up + ".bias", (width,))])
        mlp["down_bias"] = fetch(down + ".bias", (h,))
    return mlp


def decoder_from_hf(config: ModelConfig, fetch, linear, layers: list[dict]) -> dict[str, Any]:
    """The whole params pytree: `layers` plus the embedding, final norm and LM head."""
    h = config.hidden_size
    params: dict[str, Any] = {
        "embed": fetch("model.embed_tokens.weight", (config.vocab_size, h)),
        "layers": layers,
        "final_norm": fetch("model.norm.weight", (h,)),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = linear("lm_head.weight", h, config.vocab_size)
    return params


def llama_params(config: ModelConfig, get: TensorGetter, quantization: str | None = None
                 ) -> dict[str, Any]:
    """LlamaForCausalLM (and Mistral, Qwen2, Qwen3) tensors -> `jaxpage.models.llama`'s
    layout."""
    fetch, linear = hf_fetchers(config, get, quantization)
    layers = [{**attention_from_hf(config, fetch, linear, n),
               **mlp_from_hf(config, fetch, linear, f"model.layers.{n}.mlp.",
                             config.intermediate_size)}
              for n in range(config.num_layers)]
    return decoder_from_hf(config, fetch, linear, layers)


def gemma_params(config: ModelConfig, get: TensorGetter, quantization: str | None = None
                 ) -> dict[str, Any]:
    """Gemma2ForCausalLM / Gemma3ForCausalLM tensors -> `jaxpage.models.gemma`'s layout: the
    Llama layout with the sandwich norms around each sublayer."""
    fetch, linear = hf_fetchers(config, get, quantization)
    h = config.hidden_size
    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        layers.append({
            "attn_norm": fetch(p + "input_layernorm.weight", (h,)),
            **attention_params(config, fetch, linear, p),
            "post_attn_norm": fetch(p + "post_attention_layernorm.weight", (h,)),
            "mlp_norm": fetch(p + "pre_feedforward_layernorm.weight", (h,)),
            **mlp_from_hf(config, fetch, linear, p + "mlp.", config.intermediate_size),
            "post_mlp_norm": fetch(p + "post_feedforward_layernorm.weight", (h,)),
        })
    return decoder_from_hf(config, fetch, linear, layers)


# Where an HF checkpoint keeps a MoE layer's router and experts ("model.layers.N.<block>.gate",
# "...<block>.experts.E.<gate|up|down>"): the Hub's per-expert layout, which transformers 5
# also saves.
HF_MOE_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def moe_params(config: ModelConfig, get: TensorGetter, quantization: str | None = None
               ) -> dict[str, Any]:
    """MixtralForCausalLM / Qwen3MoeForCausalLM tensors -> `jaxpage.models.moe`'s layout:
    Llama's attention, norms and dense MLPs, plus each MoE layer's router and its experts
    stacked [E, ...]."""
    fetch, linear = hf_fetchers(config, get, quantization)
    block, names = HF_MOE_NAMES[config.architecture]
    layers = []
    for n in range(config.num_layers):
        layer = attention_from_hf(config, fetch, linear, n)
        if config.is_moe_layer(n):
            p = f"model.layers.{n}.{block}."
            experts = [mlp_from_hf(config, fetch, linear, f"{p}experts.{e}.",
                                   config.moe_intermediate_size, names)
                       for e in range(config.num_experts)]
            layer.update(router=linear(p + "gate.weight", config.hidden_size, config.num_experts),
                         experts_gate_up=quant.stack([x["gate_up"] for x in experts]),
                         experts_down=quant.stack([x["down"] for x in experts]))
        else:
            layer.update(mlp_from_hf(config, fetch, linear, f"model.layers.{n}.mlp.",
                                     config.intermediate_size))
        layers.append(layer)
    return decoder_from_hf(config, fetch, linear, layers)


# each family's converter, by its module under jaxpage.models (`jaxpage.models.FAMILIES`)
CONVERTERS: dict[str, Callable[[ModelConfig, TensorGetter, str | None], dict[str, Any]]] = {
    "llama": llama_params, "gemma": gemma_params, "moe": moe_params}
assert set(CONVERTERS) == set(FAMILIES.values())


def params_from_hf_tensors(config: ModelConfig, get: TensorGetter, dtype,
                           quantization: str | None = None) -> dict[str, Any]:
    """Convert HF-named tensors to the jaxpage params layout (numpy arrays of `dtype`) of
    the config's model family (`CONVERTERS`), the decoder's projections quantized to
    `quantization` (or as an 8-bit checkpoint stores them: `hf_fetchers`).

    Checks every tensor against the config and names the first one that is missing or has
    the wrong shape.
    """
    dtype = jnp.dtype(dtype)
    converter = CONVERTERS[FAMILIES[config.architecture]]
    return cast_params(converter(config, get, quantization), dtype)


def cast_params(params: Any, dtype: np.dtype) -> Any:
    """Contiguous numpy copies of every leaf in `dtype`; a QuantizedWeight's values and
    float32 scales are kept as they are."""
    def cast(a):
        if quantized_linear.is_quantized(a):
            return a
        return np.ascontiguousarray(np.asarray(a).astype(dtype))

    return jax.tree.map(cast, params, is_leaf=quantized_linear.is_quantized)
