"""The model families jaxpage serves, by HF architecture name.

Each family is a module with a model class (a frozen dataclass over a `ModelConfig` with
`forward(params, token_ids, positions, kv_pool, metadata)`) and `param_shapes(config)` (the
shape of every param, which the loaders check against). A family is written against the ops
of `jaxpage.layers`, which choose each op's implementation by platform and weight layout, and
knows no file format: the loaders convert checkpoints to its params layout
(`jaxpage.loading.hf_families`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from jaxpage.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

# HF architecture -> the module under jaxpage.models that serves it
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "MixtralForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
}
assert set(FAMILIES) == set(SUPPORTED_ARCHITECTURES)


def family_module(config: ModelConfig) -> ModuleType:
    """The module serving `config.architecture`."""
    return importlib.import_module(f"jaxpage.models.{FAMILIES[config.architecture]}")


def build_model(config: ModelConfig) -> Any:
    """The model object serving `config` (a jit static argument)."""
    return family_module(config).MODEL_CLASS(config)


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The expected shape of every param of `config`'s model, as a pytree of tuples."""
    return family_module(config).param_shapes(config)
