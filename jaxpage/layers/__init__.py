"""The ops a model family is written against, each choosing its implementation.

A model (`jaxpage.models`) says what it computes: a matmul, a norm, an activation, a rotary
embedding, an embedding lookup, a whole decoder layer. The modules here decide how, by
platform, dtype and weight layout: XLA's ops, or a call into the CPU kernel library
(`pallas_kernels.cpu_ops`) where it is built, through `pallas_kernels.lowering.choose` so
that accelerators lower the jnp form (decided as the model is traced where the caller names its
platform, as the runner does, else by `jax.lax.platform_dependent`); packed or plain
weights. A family is written once against them and imports no kernel itself.

    linear      matmuls and the packed weight layout (`matmul_f32`, `linear`, `pack_weight`)
    quantized_linear  8-bit weights with per-column scales (`QuantizedWeight`, `quantize`)
                and their matmuls, a MoE layer's experts' included
    norm        RMSNorm, alone and fused with the residual add before it
    activation  the gated MLP's activations (`silu_mul`)
    rotary      rotary embedding (`cos_sin`, `rotate`, `split_rotate`)
    embedding   the embedding lookup (plain, packed as a tied head, vocabulary-parallel)
    fused       a whole Llama-family layer in one CPU kernel call (`fusable`, `decoder_layer`)
    stacked     a model's layers as one array a param name, read in place by the CPU kernels
                (`StackedLayers`, `stack`)
    lora        the LoRA deltas of tokens under several adapters (`lora_matmul`)
    dispatch    where a layer's elementwise glue runs (`cpu_glue`)
"""

from jaxpage.layers.activation import ACTIVATIONS, silu_mul
from jaxpage.layers.embedding import embed
from jaxpage.layers.fused import (
    FUSED_LAYER_PARAMS,
    FUSED_LAYER_ROWS,
    FUSED_LAYER_WEIGHTS,
    decoder_layer,
    fusable,
)
from jaxpage.layers.linear import SMALL_MATMUL_ROWS, linear, matmul_f32, pack_weight, packable
from jaxpage.layers.lora import lora_matmul
from jaxpage.layers.norm import add_rms_norm, rms_norm
from jaxpage.layers.quantized_linear import (
    QUANTIZATIONS,
    QuantizedWeight,
    dequantize,
    expert_einsum,
    expert_matmul,
    is_quantized,
    quantize,
    ragged_matmul,
)
from jaxpage.layers.rotary import cos_sin, rotate, split_rotate
from jaxpage.layers.stacked import LayerWeight, StackedLayers

__all__ = [
    "ACTIVATIONS", "FUSED_LAYER_PARAMS", "FUSED_LAYER_ROWS", "FUSED_LAYER_WEIGHTS",
    "QUANTIZATIONS", "SMALL_MATMUL_ROWS", "LayerWeight", "QuantizedWeight", "StackedLayers",
    "add_rms_norm", "cos_sin", "decoder_layer", "dequantize", "embed", "expert_einsum",
    "expert_matmul", "fusable", "is_quantized", "linear", "lora_matmul", "matmul_f32",
    "pack_weight", "packable", "quantize", "ragged_matmul", "rms_norm", "rotate", "silu_mul",
    "split_rotate",
]
