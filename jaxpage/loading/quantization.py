"""Weight quantization while loading: quantize-on-load (`EngineConfig.quantization`) and
checkpoints stored quantized in the `compressed-tensors` formats.

Which weights: the decoder's projections (qkv, o, gate_up, down, a MoE layer's experts) become
`layers.QuantizedWeight`s; the embedding, the norms, the biases, a MoE router and the LM head
stay full width (vLLM's default: llm-compressor's recipes leave lm_head out, and a tied head
is the embedding). A projection is quantized as it is read, one tensor at a time on the host
(`project`), so neither the host nor the device ever holds the full-width projections of the
whole model beside the 8-bit ones.

A compressed-tensors checkpoint (config.json's `quantization_config` with quant_method
"compressed-tensors", as llm-compressor saves it) keeps, for each quantized nn.Linear,
`<name>.weight` int8 or float8_e4m3fn [out, in] and `<name>.weight_scale` float [out, 1]
(strategy "channel") or [1] (strategy "tensor", broadcast to every column here, exactly as
vLLM's `convert_to_channelwise`); the values are read as they are, never widened. Accepted:
formats "int-quantized", "float-quantized" and "naive-quantized", weights of 8 bits, type
int or float, symmetric, static, strategy channel or tensor, every group of one type. A
scheme that also quantizes activations (input_activations set, W8A8) loads as weight-only
(its weights are those of W8A16; the activation scales are not read), with a log line; any
other scheme (4-bit, groups, asymmetric, "pack-quantized") is refused, naming the field.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxpage.layers import quantized_linear
from jaxpage.layers.quantized_linear import QuantizedWeight
from jaxpage.loading.errors import WeightsError

logger = logging.getLogger("jaxpage.loading")

QUANTIZATIONS = quantized_linear.QUANTIZATIONS
_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
_TYPES = {"int": "int8", "float": "fp8"}
# the names a layer's quantized weights have in the params layout (`quantize_params`)
QUANTIZED_WEIGHTS = ("qkv", "o", "gate_up", "down", "experts_gate_up", "experts_down")


def stored_quantization(hf_config: dict[str, Any]) -> str | None:
    """"int8" / "fp8" for an HF config.json whose `quantization_config` declares a
    compressed-tensors scheme this loader reads (module doc), None without one; ValueError
    naming the field for any other."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    where = "config.json quantization_config"
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "compressed-tensors":
        raise ValueError(f"{where}.quant_method {method!r} is not supported: jaxpage reads "
                         "'compressed-tensors' int8 / fp8 checkpoints (or quantizes a "
                         "full-width one on load: quantization='int8' | 'fp8')")
    fmt = qc.get("format")
    if fmt not in _FORMATS:
        raise ValueError(f"{where}.format {fmt!r} is not supported; supported: {_FORMATS}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups is empty: no quantized weights declared")
    kinds = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        field = f"{where}.config_groups.{name}.weights"
        checks = [("num_bits", w.get("num_bits") == 8, "8"),
                  ("type", w.get("type") in _TYPES, "'int' or 'float'"),
                  ("strategy", w.get("strategy") in ("channel", "tensor"),
                   "'channel' or 'tensor'"),
                  ("symmetric", w.get("symmetric", True) is True, "true"),
                  ("dynamic", not w.get("dynamic", False), "false"),
                  ("group_size", w.get("group_size") is None, "null")]
        for key, ok, expected in checks:
            if not ok:
                raise ValueError(f"{field}.{key} is {w.get(key)!r}; jaxpage reads {expected} "
                                 "(8-bit symmetric weights, a scale per channel or tensor)")
        kinds.add(_TYPES[w["type"]])
        if group.get("input_activations"):
            logger.warning("%s.config_groups.%s quantizes activations too (%s); jaxpage runs "
                           "its weights as weight-only (W8A16), the activations in the engine "
                           "dtype", where, name, group["input_activations"].get("type"))
    if len(kinds) != 1:
        raise ValueError(f"{where}.config_groups mix weight types {sorted(kinds)}; jaxpage "
                         "reads checkpoints of one")
    return kinds.pop()


def resolve(requested: str | None, stored: str | None, source: str) -> str | None:
    """The quantization a load produces: the checkpoint's own (`stored`) unless `requested`
    asks for another, which is refused (the values are already rounded to one format);
    `requested` for a full-width checkpoint."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization {requested!r} is not one of {QUANTIZATIONS}")
    if stored is not None and requested is not None and requested != stored:
        raise ValueError(f"quantization {requested!r} was asked for, but {source} is stored "
                         f"quantized as {stored} (compressed-tensors): use quantization="
                         f"{stored!r} or leave it unset")
    return requested or stored


def is_stored_quantized(tensor: np.ndarray) -> bool:
    """Whether a checkpoint tensor holds 8-bit values (with a `weight_scale` beside it)."""
    return np.dtype(tensor.dtype) in (np.dtype(np.int8),
                                      quantized_linear.VALUE_DTYPES["fp8"])


def stored_weight(values: np.ndarray, scale: np.ndarray | None, name: str) -> QuantizedWeight:
    """A compressed-tensors weight [out, in] and its weight_scale ([out, 1], [out] or a
    per-tensor [1] / []) -> the QuantizedWeight of the params layout [in, out], scale
    float32 [out]; WeightsError naming the tensor when the scale is missing or misshapen."""
    out = values.shape[0]
    scale_name = name.removesuffix("weight") + "weight_scale"
    if scale is None:
        raise WeightsError(f"tensor {name!r} is stored in 8 bits ({values.dtype}) but "
                           f"{scale_name!r} is missing")
    scale = np.asarray(scale, np.float32)
    if scale.size == 1:  # strategy "tensor": one scale for every column
        scale = np.full((out,), scale.reshape(()), np.float32)
    elif scale.shape in ((out, 1), (out,)):
        scale = scale.reshape(out)
    else:
        raise WeightsError(f"tensor {scale_name!r} has shape {tuple(scale.shape)}; expected "
                           f"({out}, 1) (a scale per output channel) or (1,) (per tensor)")
    return QuantizedWeight(np.ascontiguousarray(values.T), scale)


def join_columns(ws: list) -> Any:
    """Projections [in, out_i] side by side (q/k/v, gate/up). Parts in different formats (a
    checkpoint that quantized some of them) meet in the 8-bit one: the full-width parts are
    quantized to it, the stored ones kept."""
    formats = {w.format for w in ws if quantized_linear.is_quantized(w)}
    if len(formats) > 1:
        raise WeightsError(f"the parts of one fused projection are stored in formats "
                           f"{sorted(formats)}")
    if formats:
        fmt = formats.pop()
        ws = [w if quantized_linear.is_quantized(w) else quantized_linear.quantize(w, fmt)
              for w in ws]
    return quantized_linear.concat_columns(ws)


def stack(ws: list) -> Any:
    """A MoE layer's experts' projections stacked [E, in, out] (one format, as `join_columns`)."""
    formats = {w.format for w in ws if quantized_linear.is_quantized(w)}
    if formats and not all(quantized_linear.is_quantized(w) for w in ws):
        ws = [w if quantized_linear.is_quantized(w) else quantized_linear.quantize(w, *formats)
              for w in ws]
    return quantized_linear.stack(ws)


def quantize_params(params: dict[str, Any], quantization: str | None, dtype) -> dict[str, Any]:
    """Full-width params (NumPy, any float dtype: a GGUF file's conversion, a jaxpage
    checkpoint) with each layer's projections (QUANTIZED_WEIGHTS) quantized to `quantization`,
    and every other param cast to `dtype`, one layer at a time."""
    def cast(a):
        return np.ascontiguousarray(np.asarray(a).astype(dtype))

    if quantization is None:
        return params
    layers = []
    for layer in params["layers"]:
        layers.append({name: quantized_linear.quantize(w, quantization)
                       if name in QUANTIZED_WEIGHTS else cast(w) for name, w in layer.items()})
    return {name: layers if name == "layers" else cast(value) for name, value in params.items()}


def describe(params: dict[str, Any]) -> str:
    """A load log line's account of the weights: their bytes, those of the decoder's
    projections and the projections' format."""
    total = quantized_linear.weight_bytes(params)
    projections = [w for layer in params["layers"] for name, w in layer.items()
                   if name in QUANTIZED_WEIGHTS]
    formats = sorted({w.format if quantized_linear.is_quantized(w) else np.dtype(w.dtype).name
                      for w in projections})
    proj = quantized_linear.weight_bytes(projections)
    return (f"weights {total / 2**20:.1f} MiB, of which the decoder's projections "
            f"{proj / 2**20:.1f} MiB in {'/'.join(formats)}")
