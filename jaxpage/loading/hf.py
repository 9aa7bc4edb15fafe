"""Load an HF transformers model directory (config.json, safetensors shards, tokenizer)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.models import FAMILIES, family_module
from jaxpage.models.config import ModelConfig

# Returns the HF-layout tensor (nn.Linear weights are [out, in]) or None when absent.
TensorGetter = Callable[[str], "np.ndarray | None"]


class WeightsError(ValueError):
    """Weight files missing, corrupt or not matching the config."""


def read_hf_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json; is it an HF model directory?")
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise WeightsError(f"{config_path} is not valid JSON: {e}") from e


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of a model dir: those the index names, else every *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(
            f"no *.safetensors weights in {path!r} (only safetensors are read, not .bin/.pt)"
        )
    files = [os.path.join(path, n) for n in names]
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"weight shard {file!r} named by the index is missing")
    return files


def open_safetensors(files: list[str]) -> TensorGetter:
    """A getter over all shards; tensors are read lazily, one at a time."""
    from safetensors import SafetensorError, safe_open

    where: dict[str, Any] = {}
    for file in files:
        try:
            handle = safe_open(file, framework="np")
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read weight file {file!r}: {e}") from e
        for name in handle.keys():
            where[name] = (handle, file)

    def get(name: str) -> np.ndarray | None:
        if name not in where:
            return None
        handle, file = where[name]
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read tensor {name!r} from {file!r}: {e}") from e

    return get


def hf_fetchers(config: ModelConfig, get: TensorGetter):
    """(fetch(name, shape), linear(name, in_dim, out_dim)): HF tensors checked against the
    shape the config expects (naming the first one missing or of the wrong shape); `linear`
    also transposes nn.Linear's [out, in] to jaxpage's [in, out]."""

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

    def linear(name: str, in_dim: int, out_dim: int) -> np.ndarray:
        return fetch(name, (out_dim, in_dim)).T  # nn.Linear [out, in] -> [in, out]

    return fetch, linear


def attention_params(config: ModelConfig, fetch, linear, prefix: str) -> dict[str, np.ndarray]:
    """One layer's attention params (fused qkv, o, the config's biases and q/k norms) from
    the HF tensors under `prefix` ("model.layers.N."), through `hf_fetchers`' helpers."""
    h, d, q, kv = config.hidden_size, config.head_dim, config.q_size, config.kv_size
    p = prefix + "self_attn."
    params = {
        "qkv": np.concatenate([linear(p + "q_proj.weight", h, q),
                               linear(p + "k_proj.weight", h, kv),
                               linear(p + "v_proj.weight", h, kv)], axis=1),
        "o": linear(p + "o_proj.weight", q, h),
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


def params_from_hf_tensors(config: ModelConfig, get: TensorGetter, dtype) -> dict[str, Any]:
    """Convert HF-named tensors to the jaxpage params layout (numpy arrays of `dtype`) of
    the config's model family.

    Checks every tensor against the config and names the first one that is missing or has
    the wrong shape.
    """
    dtype = jnp.dtype(dtype)
    if FAMILIES[config.architecture] != "llama":
        return cast_params(family_module(config).params_from_hf_tensors(config, get), dtype)
    fetch, linear = hf_fetchers(config, get)
    layers = [{**attention_from_hf(config, fetch, linear, n),
               **mlp_from_hf(config, fetch, linear, f"model.layers.{n}.mlp.",
                             config.intermediate_size)}
              for n in range(config.num_layers)]
    return cast_params(decoder_from_hf(config, fetch, linear, layers), dtype)


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
    mlp = {"gate_up": np.concatenate([linear(gate + ".weight", h, width),
                                      linear(up + ".weight", h, width)], axis=1),
           "down": linear(down + ".weight", width, h)}
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


def cast_params(params: Any, dtype: np.dtype) -> Any:
    """Contiguous numpy copies of every leaf in `dtype`."""
    return jax.tree.map(lambda a: np.ascontiguousarray(np.asarray(a).astype(dtype)), params)


def load_hf_dir(path: str, dtype) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, numpy params) from an HF model directory."""
    config = ModelConfig.from_hf(read_hf_config(path))
    params = params_from_hf_tensors(config, open_safetensors(safetensors_files(path)), dtype)
    return config, params
