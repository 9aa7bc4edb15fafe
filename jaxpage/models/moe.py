"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): the Llama-family decoder whose MoE
layers route each token to `num_experts_per_tok` of `num_experts` gated MLPs.

Params are llama.py's, except that a MoE layer (`ModelConfig.is_moe_layer`) has, instead of
"gate_up" / "down":

    {"router": [H, E], "experts_gate_up": [E, H, 2I], "experts_down": [E, I, H]}

with E = num_experts and I = moe_intermediate_size; Qwen3-MoE's other layers keep the dense
MLP ("gate_up" / "down", `intermediate_size` wide).

Routing follows HF: softmax over the router logits in float32, the top k (ties broken as
torch.topk on CPU breaks them), renormalized to sum to 1 when `norm_topk_prob` (always for
Mixtral). The experts run as a grouped matmul over only the (token, expert) pairs routed
(`grouped_experts`, `jax.lax.ragged_dot`); `dense_experts` runs every expert on every token
and is the reference it is tested against. XLA:CPU lowers ragged_dot to a masked dense dot
per group (k times the dense reference's work), so `tiled_experts`, a loop over tiles of the
routed pairs, is the grouped form that saves work on a CPU; scripts/bench_moe.py times all
three. Each takes the experts' stacks plain or 8-bit (`layers.QuantizedWeight`, a scale per
expert and column: `layers.ragged_matmul`, `layers.expert_matmul`, `layers.expert_einsum`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage import layers
from jaxpage.models import llama
from jaxpage.models.config import ModelConfig
from jaxpage.models.torch_topk import torch_cpu_topk_indices


def route(config: ModelConfig, h: jax.Array, router: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, experts [T, k] int32): each token's top-k experts by router
    probability and their routing weights, as HF computes them."""
    logits = h @ router  # [T, H] x [H, E] -> [T, E], in the model's dtype like HF's F.linear
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = top_k(probs, config.num_experts_per_tok)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices) [T, k] of each row's k largest, the set `torch.topk` picks on CPU.

    `jax.lax.top_k` gives the same set unless values tie across the k-th place, where it
    keeps the lowest indices and torch does not (see `jaxpage.models.torch_topk`). Only a
    step with such a tie pays for torch's choice: its tied rows are redone on the host.
    """
    values, indices = jax.lax.top_k(probs, k)
    if k == probs.shape[-1]:
        return values, indices
    kth = values[:, -1:]
    tied = jnp.sum(probs == kth, axis=-1) > jnp.sum(values == kth, axis=-1)  # [T]

    def torch_choice():
        chosen = jax.pure_callback(functools.partial(_torch_choice, k=k),
                                   jax.ShapeDtypeStruct(indices.shape, indices.dtype),
                                   probs, indices, tied)
        return jnp.take_along_axis(probs, chosen, axis=-1), chosen

    return jax.lax.cond(jnp.any(tied), torch_choice, lambda: (values, indices))


def _torch_choice(probs: np.ndarray, indices: np.ndarray, tied: np.ndarray, k: int):
    chosen = np.array(indices)
    for row in np.flatnonzero(tied):
        chosen[row] = torch_cpu_topk_indices(probs[row], k)
    return chosen


def grouped_experts(h: jax.Array, weights: jax.Array, experts: jax.Array,
                    gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """The routed experts' weighted sum per token, computing only the routed pairs.

    The T * k (token, expert) pairs are sorted by expert so each expert's tokens are one
    contiguous group, and two `ragged_dot`s run the groups' MLPs; the outputs are scaled by
    their routing weights and summed back onto their tokens in float32.

    h: [T, H]; weights, experts: [T, k]; gate_up: [E, H, 2I]; down: [E, I, H]. Returns [T, H].
    """
    flat, order, token, sizes = _sorted_pairs(experts, gate_up.shape[0])
    group_sizes = sizes[:-1].astype(jnp.int32)  # rows past them (no expert here): zeros
    row_expert = flat[order]  # a quantized stack's scales are by expert
    gate, up = jnp.split(layers.ragged_matmul(h[token], gate_up, group_sizes, row_expert), 2,
                         axis=-1)
    out = layers.ragged_matmul(jax.nn.silu(gate) * up, down, group_sizes,
                               row_expert)  # [T * k, H]
    return _combine(out, weights, order, token, h)


def _sorted_pairs(experts: jax.Array, num_experts: int):
    """The T * k routed (token, expert) pairs sorted by expert: (flat [T * k] experts, the
    sorting order, each sorted pair's token, the pairs per expert [E + 1]). Expert index E
    is no expert here (`local_experts`: a pair routed to another device's expert); its
    pairs sort last, in the last count."""
    flat = experts.reshape(-1)  # pair p = token p // k, its (p % k)-th choice
    order = jnp.argsort(flat, stable=True)
    return flat, order, order // experts.shape[1], jnp.bincount(flat, length=num_experts + 1)


def _combine(out: jax.Array, weights: jax.Array, order: jax.Array, token: jax.Array,
             h: jax.Array) -> jax.Array:
    """The sorted pairs' expert outputs [T * k, H] weighted by their routing weights and
    summed onto their tokens in float32, in h's dtype and shape (a pair of weight 0, such as
    one on no expert here, adds nothing, whatever its row holds)."""
    w = weights.reshape(-1)[order][:, None]
    out = jnp.where(w != 0, out.astype(jnp.float32) * w, 0.0)
    return jnp.zeros(h.shape, jnp.float32).at[token].add(out).astype(h.dtype)


def local_experts(weights: jax.Array, experts: jax.Array, num_local: int, axis: str
                  ) -> tuple[jax.Array, jax.Array]:
    """Expert parallelism: the routing of this device's experts, the `num_local` experts
    from axis_index * num_local on. A pair routed elsewhere gets weight 0 and index
    `num_local` (no expert here), so no expert function computes it; the devices' outputs
    then add up (an all-reduce) to every pair's."""
    first = jax.lax.axis_index(axis) * num_local
    mine = (experts >= first) & (experts < first + num_local)
    return (jnp.where(mine, weights, 0.0),
            jnp.where(mine, experts - first, num_local).astype(experts.dtype))


def tiled_experts(h: jax.Array, weights: jax.Array, experts: jax.Array,
                  gate_up: jax.Array, down: jax.Array, tile: int = 8) -> jax.Array:
    """What `grouped_experts` computes, without ragged_dot: each expert's pairs are padded to
    whole tiles of `tile` rows and a loop runs only the tiles that hold pairs, each against
    its one expert's weights, so the work is the routed pairs' plus at most tile - 1 rows per
    expert. A candidate for CPUs, where XLA lowers ragged_dot to a masked dense dot per
    group (every expert on every pair); scripts/bench_moe.py times all three.
    """
    num_experts, hidden = gate_up.shape[0], h.shape[1]
    flat, order, token, sizes = _sorted_pairs(experts, num_experts)
    padded = -(-sizes // tile) * tile  # the last group, no expert here, is never run
    # sorted pair j, the r-th of its expert e's, goes to padded row padded_start[e] + r
    sorted_expert = flat[order]
    rank = jnp.arange(flat.shape[0]) - (jnp.cumsum(sizes) - sizes)[sorted_expert]
    row = (jnp.cumsum(padded) - padded)[sorted_expert] + rank  # [T * k]
    num_rows = -(-(flat.shape[0] + (num_experts + 1) * (tile - 1)) // tile) * tile  # bound
    x = jnp.zeros((num_rows, hidden), h.dtype).at[row].set(h[token])
    tile_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(0, num_rows, tile),
                                   side="right")  # [num_rows / tile]

    def run_tile(t, out):
        e = tile_expert[t]
        rows = jax.lax.dynamic_slice_in_dim(x, t * tile, tile)
        gate, up = jnp.split(layers.expert_matmul(rows, gate_up, e), 2, axis=-1)
        return jax.lax.dynamic_update_slice_in_dim(
            out, layers.expert_matmul(jax.nn.silu(gate) * up, down, e), t * tile, axis=0)

    out = jax.lax.fori_loop(0, jnp.sum(padded[:-1]) // tile, run_tile, jnp.zeros_like(x))
    return _combine(out[row], weights, order, token, h)


def dense_experts(h: jax.Array, weights: jax.Array, experts: jax.Array,
                  gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """What `grouped_experts` computes, by running every expert on every token and weighting
    the unrouted ones by zero: E / k times the work, the reference for tests and benchmarks."""
    gate, up = jnp.split(layers.expert_einsum("th,ehi->eti", h, gate_up), 2, axis=-1)
    out = layers.expert_einsum("eti,eih->eth", jax.nn.silu(gate) * up, down)  # [E, T, H]
    rows = jnp.arange(experts.shape[0])[:, None]
    combine = jnp.zeros((experts.shape[0], gate_up.shape[0]), jnp.float32)
    combine = combine.at[rows, experts].add(weights)  # [T, E], zero where unrouted
    return jnp.einsum("te,eth->th", combine, out.astype(jnp.float32)).astype(h.dtype)


@dataclasses.dataclass(frozen=True)
class MoeModel(llama.LlamaModel):
    """llama.LlamaModel whose MoE layers (those with a "router") route to experts.

    `expert_fn` computes the experts; by default the platform's grouped form:
    `grouped_experts` (ragged_dot, a grouped kernel on GPU and TPU), and on CPU
    `tiled_experts`, since XLA:CPU lowers ragged_dot to every expert over every routed pair
    (scripts/bench_moe.py: at 1 / 16 / 64 tokens the tiled step was 20x / 7.9x / 8.5x faster
    than ragged_dot's and 13.5x / 4x / 2.8x faster than all experts densely). Pass
    `dense_experts` to compare. Under tensor parallelism the experts are split over the
    devices (expert parallelism: E / tp whole experts each, `local_experts`): every device
    routes every token (its activations are the same on all), runs its own experts' pairs,
    and one all-reduce adds the devices' outputs, where a dense layer all-reduces after its
    down projection.
    """

    expert_fn: Any = None
    # LoRA on experts is not served (an adapter's MLP modules have no expert layout here)
    supports_lora = False

    def _mlp(self, layer, h, live=None, *, unrounded=False, lora=None):
        if "router" not in layer:
            return super()._mlp(layer, h, live, unrounded=unrounded, lora=lora)
        weights, experts = route(self.config, h, layer["router"])
        gate_up, down = layer["experts_gate_up"], layer["experts_down"]
        if self.tp_axis is not None:  # this device's experts
            weights, experts = local_experts(weights, experts, gate_up.shape[0], self.tp_axis)
        expert_fn = self.expert_fn or (tiled_experts if jax.default_backend() == "cpu"
                                       else grouped_experts)
        return self._all_reduce(expert_fn(h, weights, experts, gate_up, down))


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """llama.param_shapes with each MoE layer's dense MLP replaced by its router and experts."""
    shapes = llama.param_shapes(config)
    h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
    for n, layer in enumerate(shapes["layers"]):
        if config.is_moe_layer(n):
            del layer["gate_up"], layer["down"]
            layer.update(router=(h, e), experts_gate_up=(e, h, 2 * i), experts_down=(e, i, h))
    return shapes


MODEL_CLASS = MoeModel
