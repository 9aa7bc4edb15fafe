"""Multi-LoRA: the request a prompt names its adapter with, a PEFT adapter read from its
directory, and its weights laid out as a device slot holds them (host side: NumPy, no JAX).

An adapter adds `delta = (x @ A) @ B` to a projection `x @ W` (PEFT's
`lora_B(lora_A(x)) * scaling`, with A = lora_A.T [in, r] and B = lora_B.T * scaling
[r, out]: the scaling `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA, is folded
into B). jaxpage's projections are fused (`qkv` = [q | k | v], `gate_up` = [gate | up]), so
a fused projection's slot holds its parts side by side along the rank axis, each padded to
`max_lora_rank`, and B block-diagonal:

    qkv:     A [H, 3R] = [A_q | A_k | A_v]     B [3R, Q + 2K], rows p*R.. write part p
    gate_up: A [H, 2R] = [A_gate | A_up]       B [2R, 2I]
    o:       A [Q, R]                          B [R, H]
    down:    A [I, R]                          B [R, H]

A part the adapter does not target is zeros (it adds nothing). The runner keeps, per layer
and projection, one stack of `max_loras + 1` such slots (slot 0 all zeros: no adapter), and
each token of a step names its slot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np

from jaxpage.validation import is_int

# PEFT's target module name -> (jaxpage's fused projection, its part)
MODULES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
TARGETS = ("qkv", "o", "gate_up", "down")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# a PEFT tensor name: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter>].weight
_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                     r"(?:\.[\w-]+)?\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with, as vLLM's `LoRARequest`: a name (what the server's
    `model` field names it by), an integer id >= 1 unique per adapter, and the PEFT
    directory it is read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if not is_int(self.lora_int_id) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str | os.PathLike) or not str(self.lora_path):
            raise ValueError(f"LoRARequest.lora_path must be a path, got {self.lora_path!r}")

    @property
    def cache_key(self) -> str:
        """What the prefix cache keys this adapter's blocks by: its name and path (blocks
        computed under one adapter are never a hit for another, nor for the base model)."""
        return f"{self.lora_name}@{os.fspath(self.lora_path)}"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA limits: device slots (adapters one step may mix), the largest rank
    a slot holds, and the adapters kept read in host memory."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


@dataclasses.dataclass
class LoRAWeights:
    """An adapter as read: per layer, per PEFT module, (A [in, r], B [r, out]) float32 with
    the scaling folded into B."""

    request: LoRARequest
    rank: int
    modules: frozenset[str]
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def projection_parts(config: Any) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per fused projection, (its input width, its parts' output widths)."""
    h, q, k, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"qkv": (h, (q, k, k)), "o": (q, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,))}


def slot_shapes(config: Any, max_rank: int) -> dict[str, tuple[int, ...]]:
    """One slot's arrays of a layer: "<target>_a" [in, parts * R], "<target>_b"
    [parts * R, out]."""
    shapes = {}
    for target, (width, parts) in projection_parts(config).items():
        shapes[f"{target}_a"] = (width, len(parts) * max_rank)
        shapes[f"{target}_b"] = (len(parts) * max_rank, sum(parts))
    return shapes


def slot_arrays(weights: LoRAWeights | None, config: Any, max_rank: int, dtype
                ) -> list[dict[str, np.ndarray]]:
    """An adapter's weights as one slot of every layer holds them (module docstring); None:
    the empty slot (zeros)."""
    parts = projection_parts(config)
    out = []
    for layer in range(config.num_layers):
        arrays = {name: np.zeros(shape, np.float32)
                  for name, shape in slot_shapes(config, max_rank).items()}
        for module, (a, b) in ({} if weights is None else weights.layers[layer]).items():
            target, part = MODULES[module]
            r = a.shape[1]
            start = part * max_rank
            offset = sum(parts[target][1][:part])
            arrays[f"{target}_a"][:, start:start + r] = a
            arrays[f"{target}_b"][start:start + r, offset:offset + b.shape[1]] = b
        out.append({name: x.astype(dtype) for name, x in arrays.items()})
    return out


def read_peft_adapter(request: LoRARequest, config: Any, max_rank: int) -> LoRAWeights:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for a
    model of `config`; a ValueError naming the adapter and what is wrong otherwise: a
    missing file, a non-LoRA or DoRA adapter, biases or modules_to_save, a target module
    jaxpage has no projection for, a rank over `max_rank`, a shape the model does not have."""
    path = os.fspath(request.lora_path)
    where = f"LoRA adapter {request.lora_name!r} ({path})"
    config_file = os.path.join(path, ADAPTER_CONFIG)
    weights_file = os.path.join(path, ADAPTER_WEIGHTS)
    for file in (config_file, weights_file):
        if not os.path.isfile(file):
            raise ValueError(f"{where}: no {os.path.basename(file)} (a PEFT LoRA directory "
                             f"has {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    try:
        with open(config_file) as f:
            peft = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not JSON: {e}") from e
    if not isinstance(peft, dict):
        raise ValueError(f"{where}: {ADAPTER_CONFIG} must hold an object")
    kind = peft.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{where}: peft_type {kind!r} is not supported (only LORA)")
    for field, allowed in (("use_dora", (False, None)), ("bias", ("none", None)),
                           ("modules_to_save", (None, [])), ("fan_in_fan_out", (False, None))):
        if peft.get(field) not in allowed:
            raise ValueError(f"{where}: {field}={peft[field]!r} is not supported")
    alpha = peft.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    alpha_pattern = peft.get("alpha_pattern") or {}
    tensors = _read_tensors(weights_file, where)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA weight of an attention "
                             f"or MLP projection (target modules: {sorted(MODULES)})")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in MODULES:
            raise ValueError(f"{where}: target module {module!r} is not supported (supported: "
                             f"{sorted(MODULES)})")
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"{where}: tensor {name!r} is for layer {layer}; the model has "
                             f"{config.num_layers}")
        pairs.setdefault((layer, module), {})[which] = value
    if not pairs:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    parts = projection_parts(config)
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(config.num_layers)]
    rank = 0
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} "
                             "without its pair")
        target, part = MODULES[module]
        width, outs = parts[target]
        lora_a, lora_b = pair["A"], pair["B"]  # [r, in], [out, r] (nn.Linear's layout)
        r = lora_a.shape[0]
        if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[1] != width or (
                lora_b.shape != (outs[part], r)):
            raise ValueError(f"{where}: layer {layer} {module} has lora_A {lora_a.shape} and "
                             f"lora_B {lora_b.shape}; this model's {module} takes [r, {width}] "
                             f"and [{outs[part]}, r]")
        if r > max_rank:
            raise ValueError(f"{where}: rank {r} (layer {layer} {module}) exceeds "
                             f"max_lora_rank {max_rank}")
        module_alpha = _pattern_value(alpha_pattern, layer, module, alpha)
        scaling = module_alpha / (math.sqrt(r) if peft.get("use_rslora") else r)
        layers[layer][module] = (np.ascontiguousarray(lora_a.T, np.float32),
                                 np.ascontiguousarray(lora_b.T * scaling, np.float32))
        rank = max(rank, r)
    modules = frozenset(module for layer in layers for module in layer)
    return LoRAWeights(request, rank, modules, layers)


def _pattern_value(pattern: dict, layer: int, module: str, default: Any) -> Any:
    """PEFT's alpha_pattern: a key matching the module's name (`layers.<i>.<...>.<module>`,
    by its end, as PEFT matches it) overrides the default."""
    for key, value in pattern.items():
        if re.search(rf"(^|\.){key}$", f"layers.{layer}.{module}") or key == module:
            return value
    return default


def _read_tensors(path: str, where: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} cannot be read: {e}") from e
    # bfloat16 tensors read as numpy's ml_dtypes type; every weight is taken as float32
    return {name: np.asarray(value, np.float32) for name, value in tensors.items()}
