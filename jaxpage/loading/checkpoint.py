"""A jaxpage checkpoint: params saved with orbax-checkpoint, config as JSON, tokenizer.

Layout of a checkpoint directory:

    jaxpage_checkpoint.json   {"format": "jaxpage-checkpoint", "format_version": 1,
                               "dtype": "float32", "config": {ModelConfig fields}}
    params/                   orbax StandardCheckpointer directory of the params pytree
    tokenizer/                tokenizer.save_pretrained(...) output (optional)

The JSON file is written last, so a directory whose save was interrupted is not a
checkpoint. Loading is a straight read of arrays already in the jaxpage layout: no
dequantizing, renaming, permuting or transposing (that happened once, at conversion).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import numpy as np

from jaxpage.loading.errors import WeightsError
from jaxpage.models import param_shapes
from jaxpage.models.config import ModelConfig, RopeConfig

FORMAT = "jaxpage-checkpoint"
FORMAT_VERSION = 1
CONFIG_FILE = "jaxpage_checkpoint.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"


def is_checkpoint(path: str) -> bool:
    """Whether `path` is a directory holding a (completely written) jaxpage checkpoint."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        return False
    try:
        with open(config_path) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """JSON-ready dict of every ModelConfig field (RopeConfig nested as a dict)."""
    return dataclasses.asdict(config)


def config_from_dict(fields: dict[str, Any]) -> ModelConfig:
    """Inverse of `config_to_dict`; WeightsError naming unknown or missing fields."""
    fields = dict(fields)
    rope = fields.pop("rope", {})
    _check_fields(RopeConfig, rope, "config.rope")
    _check_fields(ModelConfig, {**fields, "rope": None}, "config")
    for name in ("eos_token_ids", "layer_types", "mlp_only_layers"):  # JSON lists -> tuples
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    rope_local = fields.pop("rope_local", None)
    if rope_local is not None:
        _check_fields(RopeConfig, rope_local, "config.rope_local")
        fields["rope_local"] = RopeConfig(**rope_local)
    return ModelConfig(rope=RopeConfig(**rope), **fields)


def _check_fields(cls, values: Any, where: str) -> None:
    if not isinstance(values, dict):
        raise WeightsError(f"{where} must be a JSON object, got {type(values).__name__}")
    fields = dataclasses.fields(cls)
    unknown = set(values) - {f.name for f in fields}
    missing = [
        f.name
        for f in fields
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if unknown or missing:
        raise WeightsError(f"{where}: unknown fields {sorted(unknown)}, missing fields {missing}")


def check_param_shapes(config: ModelConfig, shapes: Any) -> None:
    """Raise WeightsError naming the first param (e.g. "layers.3.qkv") whose presence or
    shape disagrees with `param_shapes(config)`. `shapes` is a pytree of objects with
    `.shape` (arrays, orbax metadata) in the params layout."""

    def compare(expected: Any, actual: Any, where: str) -> None:
        if isinstance(expected, dict):
            if not isinstance(actual, dict):
                raise WeightsError(f"param {where or 'root'} should be a dict of params")
            for key in [*expected, *(k for k in actual if k not in expected)]:
                name = f"{where}.{key}" if where else key
                if key not in actual:
                    raise WeightsError(f"param {name} is missing, but the config needs it")
                if key not in expected:
                    raise WeightsError(
                        f"param {name} is not part of a {config.architecture} "
                        f"with this config (qkv_bias={config.qkv_bias}, "
                        f"qk_norm={config.qk_norm}, tied embeddings="
                        f"{config.tie_word_embeddings})"
                    )
                compare(expected[key], actual[key], name)
        elif isinstance(expected, list):
            if not isinstance(actual, list | tuple) or len(actual) != len(expected):
                got = len(actual) if isinstance(actual, list | tuple) else type(actual).__name__
                raise WeightsError(
                    f"param {where} has {got} entries, but the config has "
                    f"num_layers={len(expected)}"
                )
            for n, (e, a) in enumerate(zip(expected, actual, strict=True)):
                compare(e, a, f"{where}.{n}")
        elif tuple(actual.shape) != tuple(expected):
            raise WeightsError(
                f"param {where} has shape {tuple(actual.shape)}, but the config "
                f"expects {tuple(expected)}"
            )

    compare(param_shapes(config), shapes, "")


def check_destination(path: str, overwrite: bool = False) -> bool:
    """Raise FileExistsError unless a checkpoint may be written at `path`: it must not
    exist, be an empty directory, or (with `overwrite`) be an existing checkpoint. Returns
    whether an existing checkpoint would be replaced."""
    if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
        return False
    if not overwrite:
        raise FileExistsError(
            f"{path!r} exists and is not empty (overwrite=True / --overwrite replaces an "
            "existing checkpoint)"
        )
    if not is_checkpoint(path):
        raise FileExistsError(f"{path!r} is not a jaxpage checkpoint; refusing to replace it")
    return True


def save_checkpoint(
    path: str, config: ModelConfig, params: Any, tokenizer: Any = None, overwrite: bool = False
) -> None:
    """Write a checkpoint directory at `path` (created; must not exist or be empty, unless
    `overwrite` and it is an existing checkpoint, which is then replaced).

    params: the params pytree (numpy or jax arrays, one dtype) matching `config`.
    tokenizer: anything with `save_pretrained(dir)` (a transformers tokenizer), or None.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    replace = check_destination(path, overwrite)
    check_param_shapes(config, params)
    params = jax.tree.map(np.asarray, params)
    dtypes = {a.dtype for a in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise ValueError(f"params mix dtypes {sorted(map(str, dtypes))}; cast them to one")
    if replace:
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, PARAMS_DIR), params)
        checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(path, TOKENIZER_DIR))
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": str(dtypes.pop()),
        "config": config_to_dict(config),
    }
    tmp = os.path.join(path, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(path, CONFIG_FILE))  # last: marks the checkpoint complete


def read_checkpoint_config(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, the whole JSON record) of a checkpoint directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise WeightsError(
            f"{path!r} has no {CONFIG_FILE}; not a jaxpage checkpoint, or its save did not finish"
        )
    try:
        with open(config_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise WeightsError(f"{config_path} is not a {FORMAT} record")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise WeightsError(
            f"{config_path} has format_version {version!r}; this jaxpage reads "
            f"version {FORMAT_VERSION}"
        )
    try:
        config = config_from_dict(meta.get("config"))
    except (WeightsError, ValueError, TypeError) as e:
        raise WeightsError(f"{config_path}: {e}") from e
    return config, meta


def load_checkpoint(
    path: str, dtype, with_tokenizer: bool = True
) -> tuple[ModelConfig, dict[str, Any], Any]:
    """(config, numpy params in the jaxpage layout cast to `dtype`, tokenizer or None).

    The tokenizer is None when the checkpoint has none or `with_tokenizer` is False.

    Raises FileNotFoundError (no directory), WeightsError (missing or corrupt config JSON,
    missing params, params whose structure or shapes disagree with the config; the
    message names the param, e.g. "layers.1.qkv").
    """
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    config, _ = read_checkpoint_config(path)
    path = os.path.abspath(path)
    params_dir = os.path.join(path, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise WeightsError(f"checkpoint {path!r} has no {PARAMS_DIR}/ directory")
    dtype = jnp.dtype(dtype)
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            stored = checkpointer.metadata(params_dir).item_metadata.tree
        except Exception as e:  # orbax raises assorted errors for damaged directories
            raise WeightsError(f"cannot read the params of checkpoint {path!r}: {e}") from e
        try:
            check_param_shapes(config, stored)
        except WeightsError as e:
            raise WeightsError(f"checkpoint {path!r}: {e}") from e
        # The target fixes the structure and the dtype (orbax casts while reading).
        target = jax.tree.map(lambda meta: np.empty(meta.shape, dtype), stored)
        params = checkpointer.restore(params_dir, target)
    return config, params, load_checkpoint_tokenizer(path) if with_tokenizer else None


def load_checkpoint_tokenizer(path: str):
    """The tokenizer saved in a checkpoint, or None when it has none."""
    tokenizer_dir = os.path.join(path, TOKENIZER_DIR)
    if not os.path.isdir(tokenizer_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)
