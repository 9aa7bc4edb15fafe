"""Tensor parallelism over a `jax.sharding.Mesh` axis "model" (Megatron's layout).

Each device holds 1/tp of every weight matrix and of the KV pool, and runs the model on its
own heads under `jax.shard_map`; the collectives are the ones the layout needs and no more:
per layer one all-reduce after the attention output projection and one after the MLP's
down projection, plus one all-reduce for the embedding lookup and one all-gather of the
logits per step.

- A mixture of experts' layer puts E / tp whole experts on each device (expert parallelism):
  every device routes every token, runs only its experts' (token, expert) pairs, and one
  all-reduce sums the devices' outputs, as after a dense MLP.
- q/k/v and gate/up are split by output columns, o_proj and down_proj by input rows, so
  each device's attention and MLP need no communication until their last matmul.
  The fused `qkv` ([H, Q + 2K]) and `gate_up` ([H, 2I]) matrices are stored interleaved by
  device, `[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`, so that a contiguous column shard is one
  device's own q, k and v heads.
- The embedding and lm_head are split by vocabulary (padded to a multiple of tp), not
  replicated: they are the largest matrices of small models (SmolLM2: 21% of its weights)
  and Llama-3's 128k vocabulary makes a replicated copy ~1 GiB per device in bfloat16. The
  lookup masks the ids outside a device's range and all-reduces; the logits are gathered.
- The KV pool `[kv_heads, blocks, block_size, head_dim]` is split over KV heads. When tp
  exceeds the KV heads, each KV head is replicated tp // num_kv_heads times (its k/v
  projection columns too), so every device holds the KV head its query heads read.

The host allocator, scheduler and block tables do not change: one block table serves every
shard. The runner places the params (host numpy arrays go to each device as their shards:
no device ever holds the full model) and the pool with the shardings here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpage.layers import quantized_linear

MODEL_AXIS = "model"

# PartitionSpecs by param name (anything else, e.g. norms and output biases, is replicated)
_SPECS = {
    "embed": P(MODEL_AXIS, None), "lm_head": P(None, MODEL_AXIS),
    "qkv": P(None, MODEL_AXIS), "qkv_bias": P(MODEL_AXIS), "o": P(MODEL_AXIS, None),
    "gate_up": P(None, MODEL_AXIS), "gate_up_bias": P(MODEL_AXIS), "down": P(MODEL_AXIS, None),
    # LoRA slot stacks [S, in, R] / [S, R, out] (jaxpage.lora): B split as its projection's
    # columns, A as its rows; the rest (qkv_a, gate_up_a, o_b, down_b) replicated
    "qkv_b": P(None, None, MODEL_AXIS), "gate_up_b": P(None, None, MODEL_AXIS),
    "o_a": P(None, MODEL_AXIS, None), "down_a": P(None, MODEL_AXIS, None),
    # a MoE layer's experts [E, ...]: E / tp whole experts on each device; the router
    # replicated (expert parallelism: jaxpage.models.moe)
    "experts_gate_up": P(MODEL_AXIS, None, None), "experts_down": P(MODEL_AXIS, None, None),
}
# An 8-bit weight (`quantized_linear.QuantizedWeight`) is sharded as its name says for its
# values, and its per-column scale [..., N] as the values' columns: split with the columns of
# a column-split weight (qkv, gate_up, lm_head), whole for a row-split one (o, down: every
# device holds all N columns), by expert for a MoE layer's stacks (`_scale_spec`). A tied
# head quantized (`quantize_lm_head`) is an `embed` of [H, V]: split as lm_head is.

# [kv_heads, ...]: split over KV heads, a pool's values (and a quantized pool's scales)
POOL_SPEC = P(MODEL_AXIS)


def valid_tp_sizes(config: Any, max_size: int) -> list[int]:
    """The tensor-parallel sizes up to `max_size` this model can be split into."""
    return [tp for tp in range(1, max_size + 1) if _refusal(config, tp) is None]


def _refusal(config: Any, tp: int) -> str | None:
    num_experts = getattr(config, "num_experts", 0)
    if num_experts and num_experts % tp:  # whole experts on each device
        return f"num_experts {num_experts} is not a multiple of it"
    if config.num_heads % tp:
        return f"num_heads {config.num_heads} is not a multiple of it"
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        return (f"it neither divides num_kv_heads {config.num_kv_heads} nor is a multiple "
                f"of it")
    if config.intermediate_size % tp:
        return f"intermediate_size {config.intermediate_size} is not a multiple of it"
    return None


def _scale_spec(spec: P) -> P:
    """The spec of an 8-bit weight's scales [..., N] given its values' [..., K, N]: the values'
    without the K axis, so the scales split with the columns (or experts) they scale."""
    parts = tuple(spec)
    return P(*parts[:-2], *parts[-1:]) if len(parts) >= 2 else spec


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How one model is split over `tp` devices (hashable: part of the jitted step's key)."""

    mesh: Mesh
    config: Any  # the model's (global) ModelConfig

    @classmethod
    def create(cls, config: Any, tp: int, devices: list | None = None) -> TensorParallel:
        devices = jax.devices() if devices is None else devices
        if tp > len(devices):
            raise ValueError(f"tensor_parallel_size {tp} exceeds the {len(devices)} devices")
        reason = _refusal(config, tp)
        if reason is not None:
            raise ValueError(
                f"tensor_parallel_size {tp} cannot split this model: {reason}; valid sizes: "
                f"{valid_tp_sizes(config, len(jax.devices()))}")
        return cls(Mesh(np.asarray(devices[:tp]), (MODEL_AXIS,)), config)

    @property
    def tp(self) -> int:
        return self.mesh.shape[MODEL_AXIS]

    @property
    def kv_replicas(self) -> int:
        """Copies of each KV head in the pool (1 unless tp > num_kv_heads)."""
        return max(1, self.tp // self.config.num_kv_heads)

    @property
    def pool_kv_heads(self) -> int:
        return self.config.num_kv_heads * self.kv_replicas

    @property
    def padded_vocab(self) -> int:
        return -(-self.config.vocab_size // self.tp) * self.tp

    def local_config(self) -> Any:
        """One device's share of the model: its heads and MLP columns (the vocabulary stays
        the global one: the logits are gathered before they are cut to it)."""
        c = self.config
        return dataclasses.replace(c, num_heads=c.num_heads // self.tp,
                                   num_kv_heads=self.pool_kv_heads // self.tp,
                                   intermediate_size=c.intermediate_size // self.tp)

    # ------------------------------------------------------------ params
    def shard_params(self, params: dict) -> dict:
        """Host params (numpy, the single-device layout) -> the TP layout (numpy), then placed
        shard by shard on the mesh."""
        layout = self.tp_layout(params)
        return jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(self.mesh, spec)),
                            layout, self.param_specs(layout))

    def tp_layout(self, params: dict) -> dict:
        """The single-device params rearranged so each device's shard is contiguous: fused
        matrices interleaved by device, KV heads replicated, the vocabulary padded."""
        qkv_columns, gate_up_columns = self._qkv_columns, self._gate_up_columns

        def pad_vocab(a: np.ndarray, axis: int) -> np.ndarray:
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, self.padded_vocab - a.shape[axis])
            return np.pad(a, pad)

        def pad_head(w: Any) -> Any:  # [H, V], or an 8-bit head's values [H, V] and scales [V]
            return quantized_linear.map_columns(w, lambda a: pad_vocab(np.asarray(a),
                                                                       a.ndim - 1))

        out = dict(params)
        embed = params["embed"]  # [V, H], or quantized as a tied head [H, V] (quantize_head)
        out["embed"] = (pad_head(embed) if quantized_linear.is_quantized(embed)
                        else pad_vocab(np.asarray(embed), 0))
        if "lm_head" in params:
            out["lm_head"] = pad_head(params["lm_head"])
        layers = []
        for layer in params["layers"]:
            layer = {k: jax.tree.map(np.asarray, v) for k, v in layer.items()}
            # an 8-bit weight's scales move with its columns (`quantized_linear.map_columns`)
            for name in ("qkv", "qkv_bias"):
                if name in layer:
                    layer[name] = quantized_linear.map_columns(layer[name], qkv_columns)
            for name in ("gate_up", "gate_up_bias"):
                if name in layer:
                    layer[name] = quantized_linear.map_columns(layer[name], gate_up_columns)
            layers.append(layer)
        out["layers"] = layers
        return out

    def lora_layout(self, layers: list[dict]) -> list[dict]:
        """A LoRA slot's per-layer arrays (jaxpage.lora.slot_arrays) in the TP layout: the
        qkv and gate_up B columns interleaved by device as their projections' are."""
        return [dict(layer, qkv_b=self._qkv_columns(layer["qkv_b"]),
                     gate_up_b=self._gate_up_columns(layer["gate_up_b"])) for layer in layers]

    def _qkv_columns(self, a: np.ndarray) -> np.ndarray:
        """[..., Q + 2K] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], KV heads replicated."""
        c, tp = self.config, self.tp
        q, kv = c.q_size, c.kv_size
        lead = a.shape[:-1]
        parts = [a[..., :q], a[..., q: q + kv], a[..., q + kv:]]
        qp = parts[0].reshape(*lead, tp, -1)
        k, v = (np.repeat(x.reshape(*lead, c.num_kv_heads, c.head_dim), self.kv_replicas,
                          axis=-2).reshape(*lead, tp, -1) for x in parts[1:])
        return np.concatenate([qp, k, v], axis=-1).reshape(*lead, -1)

    def _gate_up_columns(self, a: np.ndarray) -> np.ndarray:
        """[..., 2I] -> [gate_0 up_0 | gate_1 up_1 | ...]."""
        lead = a.shape[:-1]
        gate, up = np.split(a, 2, axis=-1)
        return np.concatenate([gate.reshape(*lead, self.tp, -1), up.reshape(*lead, self.tp, -1)],
                              axis=-1).reshape(*lead, -1)

    def layout_shapes(self, shapes: dict) -> dict:
        """`tp_layout`'s effect on param shapes (a pytree of tuples, as `param_shapes`), for
        abstract arrays: the qkv columns grow with the replicated KV heads, the vocabulary
        is padded; everything else only moves."""
        c = self.config
        qkv = c.q_size + 2 * c.kv_size * self.kv_replicas
        out = dict(shapes, embed=(self.padded_vocab, c.hidden_size))
        if "lm_head" in shapes:
            out["lm_head"] = (c.hidden_size, self.padded_vocab)
        out["layers"] = [dict(layer, qkv=(layer["qkv"][0], qkv),
                              **({"qkv_bias": (qkv,)} if "qkv_bias" in layer else {}))
                         for layer in shapes["layers"]]
        return out

    @staticmethod
    def param_specs(params: dict) -> dict:
        def spec(path, _leaf) -> P:
            last, field = path[-1], None
            if isinstance(last, jax.tree_util.GetAttrKey):  # a QuantizedWeight's array
                last, field = path[-2], last.name
            name = last.key if hasattr(last, "key") else None
            if name == "embed" and field is not None:  # a tied head quantized as [H, V]
                name = "lm_head"
            spec = _SPECS.get(name, P())
            return _scale_spec(spec) if field == "scale" else spec

        return jax.tree_util.tree_map_with_path(spec, params)

    # ------------------------------------------------------------ the pool
    @property
    def pool_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, POOL_SPEC)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


@dataclasses.dataclass(frozen=True)
class TensorParallelModel:
    """A model run tensor-parallel: the same `forward` contract as the model it wraps, over
    params in `plan`'s layout and a pool sharded over KV heads. Hashable (a static argument
    of the jitted step)."""

    local: Any  # the model over one device's share (its config local, tp_axis set)
    plan: TensorParallel

    @classmethod
    def wrap(cls, model: Any, plan: TensorParallel) -> TensorParallelModel:
        if not hasattr(model, "with_tensor_parallel"):
            raise ValueError(f"{type(model).__name__} has no tensor-parallel layout "
                             f"(with_tensor_parallel); use tensor_parallel_size 1")
        return cls(model.with_tensor_parallel(plan.local_config(), MODEL_AXIS), plan)

    @property
    def config(self) -> Any:
        return self.plan.config

    def forward(self, params, token_ids, positions, kv_pool, metadata):
        pool_specs = [(POOL_SPEC, POOL_SPEC) for _ in kv_pool]
        step = jax.shard_map(
            self.local.forward, mesh=self.plan.mesh,
            in_specs=(TensorParallel.param_specs(params), P(), P(), pool_specs, P()),
            out_specs=(P(), pool_specs), check_vma=False)
        return step(params, token_ids, positions, kv_pool, metadata)
