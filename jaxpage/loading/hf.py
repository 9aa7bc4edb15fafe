"""Load an HF transformers model directory (config.json, safetensors shards, tokenizer)."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from jaxpage.loading import quantization as quant
from jaxpage.loading.errors import WeightsError
from jaxpage.loading.hf_families import TensorGetter, params_from_hf_tensors
from jaxpage.models.config import ModelConfig


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
            if handle.get_slice(name).get_dtype() in _RAW_DTYPES:
                return _read_raw(file, name)
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise WeightsError(f"cannot read tensor {name!r} from {file!r}: {e}") from e

    return get


# safetensors dtypes its NumPy reader does not map (it looks for numpy.float8_e4m3fn), read
# here from the file: an 8-byte little-endian header length, the JSON header, the data
_RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn"}


def _read_raw(file: str, name: str) -> np.ndarray:
    import ml_dtypes

    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(length))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + length + start)
        data = f.read(end - start)
    dtype = np.dtype(getattr(ml_dtypes, _RAW_DTYPES[entry["dtype"]]))
    return np.frombuffer(data, dtype).reshape(entry["shape"])


def load_hf_dir(path: str, dtype, quantization: str | None = None
                ) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, numpy params) from an HF model directory; the decoder's projections as a
    compressed-tensors checkpoint stores them in 8 bits, or quantized to `quantization` as
    they are read (`jaxpage.loading.quantization`)."""
    hf_config = read_hf_config(path)
    config = ModelConfig.from_hf(hf_config)
    stored = quant.stored_quantization(hf_config)
    quant.resolve(quantization, stored, path)
    # a quantized checkpoint is read as stored (a projection it left full width stays so, as
    # vLLM runs it); a full-width one is quantized as asked
    params = params_from_hf_tensors(config, open_safetensors(safetensors_files(path)), dtype,
                                    None if stored else quantization)
    return config, params
