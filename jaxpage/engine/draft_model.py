"""A speculative decoding draft model as the runner runs it: the target cut to its first layers,
or a model of its own placed beside the target (`speculative_config` of method
"draft_model")."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention import select_backend
from jaxpage.engine.device_params import cast_params, pack_params, packs_weights
from jaxpage.parallel import TensorParallel, TensorParallelModel

if TYPE_CHECKING:
    from jaxpage.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class Draft:
    """A speculative decoding draft model as the runner runs it (`ModelRunner._drafting`)."""

    model: Any
    params: Any  # on the device
    name: str  # its steps' shape keys: "draft<layers>" (the target cut), "draft" (its own)
    layers: int | None  # the target's first layers it is, on the target's pool; None: its own
    kv_heads: int  # its pool's (a tensor-parallel draft's KV heads as replicated)


def build_draft(model: Any, params: Any, config: EngineConfig, draft: tuple[Any, Any] | None,
                devices: list, backend: str, dtype) -> Draft | None:
    """The draft of a speculative_config of method "draft_model" (None for any other): the
    target cut to its first `draft_layers` layers (a model of the same family over a config
    of that many layers, sharing the target's arrays), or `draft`'s (model, numpy params)
    cast to the engine's dtype and put on the device. ValueError naming the field where it
    cannot run here."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    if jax.process_count() > 1:
        raise ValueError("speculative_config.method 'draft_model' needs one process")
    tp, model_config = config.tensor_parallel_size, model.config
    if spec.model == "self":
        if tp > 1:
            raise ValueError("speculative_config.model 'self' needs tensor_parallel_size 1 "
                             "(a draft model of its own is split as the target is)")
        num_layers = spec.draft_layers
        if num_layers > model_config.num_layers:
            raise ValueError(f"speculative_config.draft_layers must be <= the model's "
                             f"{model_config.num_layers} layers, got {num_layers}")
        types = model_config.layer_types
        try:
            cut = dataclasses.replace(model, config=dataclasses.replace(
                model_config, num_layers=num_layers,
                layer_types=None if types is None else types[:num_layers]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"speculative_config.model 'self' is not supported for "
                             f"{type(model).__name__}: {exc}") from exc
        return Draft(cut, dict(params, layers=params["layers"][:num_layers]),
                     f"draft{num_layers}", num_layers, model_config.num_kv_heads)
    if draft is None:
        raise ValueError(f"speculative_config.model {spec.model!r}: the draft's model and "
                         "params were not given to the runner")
    draft_model, draft_params = draft
    draft_config, field = draft_model.config, f"speculative_config.model {spec.model!r}"
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"{field} has a vocabulary of {draft_config.vocab_size} tokens, the "
                         f"target {model_config.vocab_size}: a draft must share the target's "
                         "vocabulary")
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else jnp.dtype(config.kv_cache_dtype)
    draft_backend = select_backend(config.attention_backend, interpret=config.kernel_interpret,
                                   head_dim=draft_config.head_dim,
                                   block_size=config.block_size, dtype=kv_dtype)
    if draft_backend != backend:
        raise ValueError(f"{field} takes the attention backend {draft_backend!r} (head_dim "
                         f"{draft_config.head_dim}), the target {backend!r}: both must run on "
                         "one")
    draft_params = cast_params(draft_params, dtype)
    device = devices[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:  # its share of each device's memory
        size = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(draft_params)) // tp
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if size > free:
            raise ValueError(f"{field}: its weights ({size} bytes a device) do not fit the "
                             f"{free} bytes left on {device}")
    if tp > 1:  # split over the target's devices as the target is
        try:
            plan = TensorParallel.create(draft_config, tp, devices)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from exc
        return Draft(TensorParallelModel.wrap(draft_model, plan),
                     plan.shard_params(draft_params), "draft", None, plan.pool_kv_heads)
    if packs_weights(draft_model, device, dtype):
        draft_params = pack_params(draft_model, draft_params)
    return Draft(draft_model, jax.device_put(draft_params, device), "draft", None,
                 draft_config.num_kv_heads)
