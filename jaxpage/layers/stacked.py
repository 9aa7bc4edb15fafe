"""A model's layers stacked per kind: one array a param name, with a leading layer axis.

A step's jitted call takes every array it reads as an argument, and the host pays for each
as it dispatches the call: JAX flattens and checks it, PJRT holds its buffer and records its
use. A 30-layer model kept as one dict of arrays a layer hands a CPU step 180 params (242 with
its pools; 373 with int8 weights and their scales), and dispatching them cost the host 0.9
ms a step after a decode step's weight stream had swept its caches, against 0.55 ms with the
params stacked (`scripts/lab/bench_dispatch.py`). On the two cores a CPU runner has, that
host time is taken from the layers' own threads.

Slicing a layer out of a stack inside the jitted step is no answer on XLA:CPU: the slice is a
copy, and a weight-bound decode step that copies every layer's weights before reading them
reads them twice (an early measurement of this project: a 1-row step ~7x slower). So the
stack is read in place: the CPU kernels that take a layer's weights (the packed matmuls and
the fused decoder layer) take the stack and a layer index, and offset into it. A model's
forward sees each layer as a dict of `LayerWeight`s (a stack and an index), which
`linear.matmul_f32` and `fused.decoder_layer` hand to those kernels; a norm's [H] vector,
where a step runs a layer unfused, is sliced out (`array`: a few hundred bytes copied).

Only a CPU runner's packed weights are stacked (`stack`: every layer a Llama-family layer,
`fused.FUSED_LAYER_PARAMS` with its projections packed for the kernel, plus any vectors:
biases, q/k norms); every other layout keeps its list of per-layer dicts. On an accelerator
a stack would be read by `jax.lax.scan` or a slice, whose cost there is its own measurement
(docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpage.layers import quantized_linear
from pallas_kernels import cpu_ops


@dataclasses.dataclass(frozen=True)
class StackedLayers:
    """A model's `params["layers"]` stacked: `arrays` maps each name of a layer's params to one
    array [L, ...] (an 8-bit weight to a `QuantizedWeight` of [L, ...] values and [L, N]
    scales). A pytree of its arrays. `count`: the layers a forward runs, the first `count` of
    the L (a draft of the model's first layers runs on the target's arrays: `[:n]` takes them
    without a copy). Indexing a layer gives its dict of arrays, copied out (for inspection);
    a forward reads layers in place through `layer`."""

    arrays: dict[str, Any]
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.count)
            if start != 0 or step != 1:
                raise IndexError(f"stacked layers take a slice of their first layers [:n], got "
                                 f"{index}")
            return StackedLayers(self.arrays, stop)
        if not -self.count <= index < self.count:
            raise IndexError(f"layer {index} of {self.count}")
        index %= self.count
        return {name: array[index] for name, array in self.arrays.items()}

    def __iter__(self):
        return (self[i] for i in range(self.count))

    def layer(self, index: int, in_place: frozenset[str]) -> dict[str, Any]:
        """Layer `index`'s params for a forward: those named in `in_place` as `LayerWeight`s
        (what the kernels read in place), the others (vectors: biases, q/k norms) sliced out
        of their stacks (a few hundred bytes copied)."""
        if not 0 <= index < self.count:
            raise IndexError(f"layer {index} of {self.count}")
        return {name: LayerWeight(array, index) if name in in_place else array[index]
                for name, array in self.arrays.items()}


jax.tree_util.register_dataclass(StackedLayers, data_fields=["arrays"], meta_fields=["count"])


@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """Layer `index` of a stack (`StackedLayers.layer`): what the CPU kernels read in place
    with their `layer` argument. Not a pytree: it exists while a forward is traced."""

    stacked: Any
    index: int

    @property
    def quantized(self) -> bool:
        return quantized_linear.is_quantized(self.stacked)

    @property
    def ndim(self) -> int:
        return len(self.stacked.shape) - 1

    @property
    def dtype(self):
        return self.stacked.dtype

    def array(self) -> Any:
        """The layer's array sliced out of the stack (a copy under XLA): for small params."""
        return self.stacked[self.index]


def is_layer_weight(w: Any) -> bool:
    return isinstance(w, LayerWeight)


def array(w: Any) -> Any:
    """w, or a `LayerWeight`'s layer sliced out (`LayerWeight.array`)."""
    return w.array() if is_layer_weight(w) else w


def matmul_f32(x: jax.Array, w: LayerWeight, *, live_rows: jax.Array | None = None
               ) -> jax.Array:
    """x [M, K] @ one layer of a stack of packed weights, float32 [M, N]: the kernel's packed
    matmul (int8 or float) reading that layer in place."""
    if w.quantized:
        return cpu_ops.packed_matmul_int8(x, w.stacked.values, w.stacked.scale,
                                          live_rows=live_rows, layer=w.index)
    return cpu_ops.packed_matmul(x, w.stacked, live_rows=live_rows, layer=w.index)


def _kernel_packed(w: Any) -> bool:
    """Whether a weight is in a layout only the CPU kernels read: packed float ([P, KG, PANEL,
    G]) or packed int8."""
    if quantized_linear.is_quantized(w):
        return w.packed
    return np.ndim(w) == 4


def _signature(w: Any) -> tuple:
    if quantized_linear.is_quantized(w):
        return ("8-bit", w.packed, tuple(np.shape(w.values)), str(w.values.dtype),
                tuple(np.shape(w.scale)))
    return ("array", tuple(np.shape(w)), str(w.dtype))


def stack(param_layers: list[dict], required: frozenset[str], transform=None
          ) -> StackedLayers | None:
    """Per-layer param dicts as `StackedLayers` (NumPy, on the host), each param first put
    through `transform(name, w)` (e.g. packing it for the kernel), or None where they do not
    stack: every layer must have the same param names, the `required` ones among them and
    any others vectors (biases, q/k norms), each name of one shape, dtype and kind across the
    layers, and every transformed matrix packed for the kernel (what the kernels read with a
    layer index; the vectors are sliced). Each stack is filled layer by layer, so the host
    holds the params once more, not twice more."""
    transform = transform or (lambda name, w: w)
    names = set(param_layers[0]) if param_layers else set()
    if (not param_layers or not required <= names
            or any(set(layer) != names for layer in param_layers)
            or any(np.ndim(param_layers[0][name]) != 1 for name in names - required)):
        return None
    first = {name: transform(name, w) for name, w in param_layers[0].items()}
    if any(_signature(layer[name]) != _signature(param_layers[0][name])
           for layer in param_layers[1:] for name in names):
        return None
    if any((quantized_linear.is_quantized(w) or np.ndim(w) > 1) and not _kernel_packed(w)
           for w in first.values()):
        return None

    def filled(name: str, *parts) -> list[np.ndarray]:  # each part's stack [L, ...]
        outs = [np.empty((len(param_layers),) + np.shape(part(first[name])),
                         np.asarray(part(first[name])).dtype) for part in parts]
        for i, layer in enumerate(param_layers):
            w = first[name] if i == 0 else transform(name, layer[name])
            for out, part in zip(outs, parts, strict=True):
                out[i] = np.asarray(part(w))
        return outs

    arrays: dict[str, Any] = {}
    for name, w in first.items():
        if quantized_linear.is_quantized(w):
            values, scale = filled(name, lambda q: q.values, lambda q: q.scale)
            arrays[name] = quantized_linear.QuantizedWeight(values, scale, w.packed)
        else:
            arrays[name] = filled(name, lambda a: a)[0]
    return StackedLayers(arrays, len(param_layers))
