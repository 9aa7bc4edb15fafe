"""Gemma 2 and Gemma 3 (text) decoders: the Llama decoder with Gemma's numerics.

What differs from `jaxpage.models.llama` (all as HF transformers computes it):

* every RMSNorm scales by 1 + weight, in float32 before the cast back;
* each sublayer's output is normed again before the residual add ("sandwich" norms):
  input_layernorm -> attention -> post_attention_layernorm, then
  pre_feedforward_layernorm -> GeGLU MLP -> post_feedforward_layernorm;
* embeddings are multiplied by sqrt(hidden_size), rounded to the activation dtype first;
* the softmax scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
* sliding-window layers (`config.layer_windows`) alternate with global ones, and on
  Gemma 3 the sliding ones have a rotary embedding of their own (`config.rope_local`);
* Gemma 2 soft-caps the attention scores and the final logits; Gemma 3 normalizes each
  head of q and k (q_norm / k_norm) instead.

Params are the Llama layout (see llama.py), with two more norms per layer:

    {"embed": [V, H],
     "layers": [{"attn_norm": [H], "qkv": [H, Q + 2K], "o": [Q, H], "post_attn_norm": [H],
                 "mlp_norm": [H], "gate_up": [H, 2I], "down": [I, H], "post_mlp_norm": [H],
                 # Gemma 3:
                 "q_norm": [D], "k_norm": [D]}, ...],
     "final_norm": [H]}            # "lm_head": [H, V] only for untied embeddings

Norm weights are stored as HF stores them (the offset from 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxpage import layers
from jaxpage.attention import AttentionMetadata, LayerKV
from jaxpage.models import llama
from jaxpage.models.config import ModelConfig
from jaxpage.models.llama import LlamaModel, Params, layer_loras, rope_cos_sin


@dataclasses.dataclass(frozen=True)
class GemmaModel(LlamaModel):
    """A Gemma 2 / 3 model; same contract as LlamaModel (tensor parallelism included: the
    extra norms are replicated like the others)."""

    def _norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return layers.rms_norm(x, weight, self.config.rms_norm_eps, unit_offset=True)

    def forward(
        self,
        params: Params,
        token_ids: jax.Array,
        positions: jax.Array,
        kv_pool: list[LayerKV],
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, list[LayerKV]]:
        """Run the decoder over a ragged, token-flat batch (see LlamaModel.forward)."""
        cfg = self.config
        x = self.embed(params, token_ids)  # [T, H]
        # HF rounds the scale to the embedding dtype (sqrt(3072) is 55.5 in bfloat16)
        x = x * jnp.asarray(cfg.hidden_size**0.5, jnp.float32).astype(x.dtype)
        global_rope = rope_cos_sin(cfg, positions, x.dtype)
        local_rope = (global_rope if cfg.rope_local is None
                      else rope_cos_sin(cfg, positions, x.dtype, cfg.rope_local))
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        new_pool = []
        live = metadata.query_start_loc[-1]  # the step's tokens (LlamaModel.forward)
        for layer, layer_kv, window, lora in zip(params["layers"], kv_pool, cfg.layer_windows,
                                                 layer_loras(params), strict=True):
            cos, sin = global_rope if window is None else local_rope
            attn_out, layer_kv = self._attention(
                layer, self._norm(x, layer["attn_norm"]), cos, sin, layer_kv, metadata, live,
                lora=lora, scale=scale, sliding_window=window, soft_cap=cfg.attn_logit_softcap)
            x = x + self._norm(attn_out, layer["post_attn_norm"])
            mlp_out = self._mlp(layer, self._norm(x, layer["mlp_norm"]), live, lora=lora)
            x = x + self._norm(mlp_out, layer["post_mlp_norm"])
            new_pool.append(layer_kv)
        return self._output(params, x, metadata), new_pool


MODEL_CLASS = GemmaModel


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The expected shape of every param: Llama's plus the two post-sublayer norms."""
    shapes = llama.param_shapes(config)
    for layer in shapes["layers"]:
        layer["post_attn_norm"] = layer["post_mlp_norm"] = (config.hidden_size,)
    return shapes

