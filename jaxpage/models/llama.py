"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) as pure functions.

Params are a plain pytree with one dict per layer (a CPU runner's packed params may instead
hold the layers stacked, one array a name read in place by the kernels: `layers.stacked`,
since slicing layers out of stacked arrays inside the jitted step copies them on XLA:CPU):

    {"embed": [V, H],
     "layers": [{"attn_norm": [H], "qkv": [H, Q + 2K], "o": [Q, H],
                 "mlp_norm": [H], "gate_up": [H, 2I], "down": [I, H],
                 # optional, by architecture:
                 "qkv_bias": [Q + 2K], "o_bias": [H], "q_norm": [D], "k_norm": [D],
                 "gate_up_bias": [2I], "down_bias": [H]}, ...],
     "final_norm": [H],
     "lm_head": [H, V]}            # absent when embeddings are tied

and, in a step where some tokens run under a LoRA adapter (jaxpage.lora), `"lora":
{"slots": [T] int32 (each token's adapter slot, 0: none), "layers": [{"qkv_a": [S, H, 3R],
"qkv_b": [S, 3R, Q + 2K], "o_a", "o_b", "gate_up_a", "gate_up_b", "down_a", "down_b"}, ...]}`:
each projection adds its tokens' adapters' `(x @ A[slot]) @ B[slot]` (`layers.lora_matmul`).

with Q = num_heads * head_dim, K = num_kv_heads * head_dim. Weights are stored
[in, out] (transposed from HF's nn.Linear layout) and q/k/v and gate/up are fused so a
layer runs three matmuls instead of seven.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxpage import layers
from jaxpage.attention import AttentionMetadata, LayerKV, paged_attention
from jaxpage.models.config import ModelConfig, RopeConfig, rope_inv_freq

Params = dict[str, Any]

# the projections `pack_params` packs for the CPU kernel's packed matmul
PACKED_WEIGHTS = ("qkv", "o", "gate_up", "down")


def pack_params(params: Params, stack: bool = False) -> Params:
    """The params with each layer's projections (PACKED_WEIGHTS) and the LM head (`lm_head`, or
    a tied `embed` as [H, V]) packed where `layers.packable` (`layers.pack_weight`), and
    int8 projections (`layers.QuantizedWeight`) where the kernel library packs int8
    (`quantized_linear.packable`): the layout a CPU runner keeps them in, so that every matmul
    of them streams its weights in order. `layers.matmul_f32` and `layers.embed` take packed
    weights as they take the others; the engine packs only where the kernel library is
    available. With `stack`, the layers are kept as one array a param name
    (`layers.StackedLayers`, read in place by the kernels) where every layer has the params of
    FUSED_LAYER_PARAMS, its projections packed, and otherwise only vectors (biases, q/k
    norms); otherwise as a list of dicts."""
    def pack(name, w):  # NumPy params pack on the host; the others are kept
        if name not in PACKED_WEIGHTS:
            return w
        if layers.is_quantized(w):  # int8 for the kernel's int8 packed matmul, where it has one
            return layers.quantized_linear.pack(w) if layers.quantized_linear.packable(w) else w
        return layers.pack_weight(w) if layers.packable(w) else w

    packed_layers = (layers.stacked.stack(params["layers"], layers.FUSED_LAYER_PARAMS, pack)
                     if stack else None)
    if packed_layers is None:
        packed_layers = [{name: pack(name, w) for name, w in layer.items()}
                         for layer in params["layers"]]
    out = dict(params, layers=packed_layers)
    head = "lm_head" if "lm_head" in params else "embed"
    if layers.is_quantized(params[head]):  # quantize_lm_head: [H, V] either way
        if layers.quantized_linear.packable(params[head]):
            out[head] = layers.quantized_linear.pack(params[head])
    elif head == "lm_head":
        if layers.packable(params["lm_head"]):
            out["lm_head"] = layers.pack_weight(params["lm_head"])
    elif layers.packable(params["embed"].T):
        # a tied head: the embedding table [V, H] packed as the head's [H, V] (`layers.embed`
        # reads its rows back out of the panels)
        out["embed"] = layers.pack_weight(params["embed"].T)
    return out


def rope_cos_sin(config: ModelConfig, positions: jax.Array, dtype,
                 rope: RopeConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [T, head_dim] for the given positions [T], of `rope` (default
    config.rope; Gemma 3's sliding layers have a rope of their own)."""
    rope = config.rope if rope is None else rope
    return layers.cos_sin(rope_inv_freq(config.head_dim, rope), positions, dtype)


@dataclasses.dataclass(frozen=True)
class LlamaModel:
    """A served model: its config plus a pure forward over (params, kv_pool, metadata).

    Hashable, so `jax.jit` can take it as a static argument; params are always traced.
    With `tp_axis` set it is one device's share of a tensor-parallel model (run under
    `jax.shard_map`, see `jaxpage.parallel`): its config holds the local head and MLP sizes,
    and it all-reduces over `tp_axis` where a sharded matmul leaves partial sums.
    """

    config: ModelConfig
    tp_axis: str | None = None
    # on CPU, a step of few tokens runs each plain layer as one kernel call (`_fused`)
    fuse_layers: bool = True
    # its projections take LoRA adapters (params["lora"]: see the module docstring)
    supports_lora = True

    @property
    def reads_stacked_layers(self) -> bool:
        """Whether its forward reads params["layers"] stacked (`layers.StackedLayers`, each
        layer's params `LayerWeight`s) as well as a dict a layer: this class's forward,
        attention and MLP do; a subclass that overrides any of them is taken to read a dict a
        layer (Gemma, MoE, a user's own) unless it sets this to True."""
        return all(getattr(type(self), name) is getattr(LlamaModel, name)
                   for name in ("forward", "_attention", "_mlp"))

    def with_tensor_parallel(self, local_config: ModelConfig, axis: str) -> LlamaModel:
        return dataclasses.replace(self, config=local_config, tp_axis=axis)

    def pack_params(self, params: Params, stack: bool = False) -> Params:
        """The params as a CPU runner keeps them: see the module-level `pack_params`."""
        return pack_params(params, stack and self.reads_stacked_layers)

    def _all_reduce(self, x: jax.Array) -> jax.Array:
        return x if self.tp_axis is None else jax.lax.psum(x, self.tp_axis)

    def embed(self, params: Params, token_ids: jax.Array) -> jax.Array:
        """[T] ids -> [T, H] (`layers.embed`: a plain table, one packed as a tied head by
        `pack_params`, or tensor-parallel this device's vocabulary range)."""
        return layers.embed(params["embed"], token_ids, self.config.hidden_size, self.tp_axis,
                            dtype=params["final_norm"].dtype)

    def forward(
        self,
        params: Params,
        token_ids: jax.Array,
        positions: jax.Array,
        kv_pool: list[LayerKV],
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, list[LayerKV]]:
        """Run the decoder over a ragged, token-flat batch.

        Args:
          params: the params pytree (see module docstring).
          token_ids: [T] int32.
          positions: [T] int32 position of each token within its sequence.
          kv_pool: per layer (k_pool, v_pool), [num_kv_heads, num_blocks, block_size, head_dim].
          metadata: the step's AttentionMetadata.

        Returns:
          (logits [R, vocab] float32 for the rows in metadata.logits_indices, or all T rows,
           the updated kv_pool).
        """
        cfg = self.config
        x = self.embed(params, token_ids)  # [T, H]
        cos, sin = rope_cos_sin(cfg, positions, x.dtype)
        new_pool = []
        live = metadata.query_start_loc[-1]  # the step's tokens; the bucket's padding follows
        param_layers = params["layers"]
        if isinstance(param_layers, layers.StackedLayers):  # each layer read in place
            param_layers = [param_layers.layer(i, layers.FUSED_LAYER_PARAMS)
                            for i in range(len(param_layers))]
        # each residual add is fused with the norm after it (`layers.add_rms_norm`): the next
        # sublayer's input norm, and after the last layer the final norm
        next_norms = [layer["attn_norm"] for layer in param_layers[1:]] + [params["final_norm"]]
        x, h = self._add_norm(x, None, param_layers[0]["attn_norm"])
        for layer, layer_kv, window, next_norm, lora in zip(
                param_layers, kv_pool, cfg.layer_windows, next_norms, layer_loras(params),
                strict=True):
            if (window is None and lora is None
                    and self._fused(layer, layer_kv, next_norm, x, metadata)):
                x, h, layer_kv = layers.decoder_layer(
                    x, h, layer, cos, sin, layer_kv, metadata, next_norm,
                    num_heads=cfg.num_heads, eps=cfg.rms_norm_eps, live_rows=live)
                new_pool.append(layer_kv)
                continue
            options = {} if window is None else {"sliding_window": window}  # Mistral
            attn_out, layer_kv = self._attention(layer, h, cos, sin, layer_kv, metadata, live,
                                                 unrounded=True, lora=lora, **options)
            x, h = self._add_norm(x, attn_out, layer["mlp_norm"])
            x, h = self._add_norm(x, self._mlp(layer, h, live, unrounded=True, lora=lora),
                                  next_norm)
            new_pool.append(layer_kv)
        return self._logits(params, h, metadata), new_pool

    def _fused(self, layer, layer_kv, next_norm, x: jax.Array, metadata: AttentionMetadata
               ) -> bool:
        """Whether this layer runs as one CPU kernel call (`layers.decoder_layer`, bit for bit
        the unfused calls): a SiLU model on one device whose layer and step the kernel takes
        (`layers.fusable`: a plain layer, packed, of a step of few tokens)."""
        return (self.fuse_layers and self.tp_axis is None and self.config.hidden_act == "silu"
                and layers.fusable(layer, layer_kv, next_norm, x, metadata,
                                   self.config.head_dim))

    def _output(self, params: Params, x: jax.Array, metadata: AttentionMetadata) -> jax.Array:
        """The last layer's [T, H] output -> logits of the rows the metadata asks for."""
        return self._logits(params, self._norm(x, params["final_norm"]), metadata)

    def _logits(self, params: Params, h: jax.Array, metadata: AttentionMetadata) -> jax.Array:
        """The final norm's [T, H] output -> logits of the rows the metadata asks for."""
        if metadata.logits_indices is None:
            return self.compute_logits(params, h, metadata.query_start_loc[-1])
        # [R, H]
        return self.compute_logits(params, h[metadata.logits_indices], metadata.num_logits)

    def compute_logits(self, params: Params, hidden: jax.Array,
                       live_rows: jax.Array | None = None) -> jax.Array:
        """[R, H] final hidden states -> [R, vocab] float32 logits (soft-capped when the
        config says so: Gemma 2); rows past `live_rows` are padding (see `layers.linear`)."""
        if "lm_head" in params:
            # [R, H] x [H, V] -> [R, V]
            logits = layers.matmul_f32(hidden, params["lm_head"], live_rows=live_rows)
        elif params["embed"].ndim == 4 or layers.is_quantized(params["embed"]):
            # tied, packed as the head [H, V] (pack_params), or quantized as it (8-bit [H, V])
            logits = layers.matmul_f32(hidden, params["embed"], live_rows=live_rows)
        else:  # tied: [R, H] x [V, H]^T -> [R, V]
            logits = layers.matmul_f32(hidden, params["embed"], transpose_w=True)
        if self.tp_axis is not None:
            # each device has its vocabulary range: gather them, drop the padding
            logits = jax.lax.all_gather(logits, self.tp_axis, axis=1, tiled=True)
            logits = logits[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def _norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return layers.rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(self, x: jax.Array, delta: jax.Array | None, weight: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
        """(x + delta in x's dtype, its norm): `layers.add_rms_norm`, one kernel call on CPU (a
        norm of stacked layers sliced out: `layers.stacked.array`)."""
        return layers.add_rms_norm(x, delta, layers.stacked.array(weight),
                                   self.config.rms_norm_eps)

    def _sublayer_output(self, out: jax.Array, layer, bias: str, dtype, unrounded: bool
                         ) -> jax.Array:
        """A sublayer's last matmul's float32 output as the residual stream takes it: left
        unrounded for the caller's add (`layers.add_rms_norm` rounds it) where nothing comes
        between, else rounded to `dtype`, all-reduced and biased."""
        if unrounded and self.tp_axis is None and bias not in layer:
            return out
        out = self._all_reduce(out.astype(dtype))
        return out + layer[bias] if bias in layer else out

    def _attention(self, layer, h, cos, sin, layer_kv, metadata, live=None, *,
                   unrounded=False, lora=None, **attention_options):
        """Attention of one layer; `live`: the step's tokens (`layers.linear`'s live_rows);
        `attention_options` go to `paged_attention` (scale, sliding_window, soft_cap). With
        `unrounded`, the output may be the o projection's float32 (`_sublayer_output`);
        `lora`: the layer's LoRA stacks and the tokens' slots (`layer_loras`), or None."""
        cfg = self.config
        num_tokens = h.shape[0]
        # [T, H] x [H, Q + 2K] -> [T, Q + 2K], float32
        qkv = add_lora(layers.matmul_f32(h, layer["qkv"], live_rows=live), h, lora, "qkv", live)
        if "qkv_bias" in layer or "q_norm" in layer:
            qkv = qkv.astype(h.dtype)
            if "qkv_bias" in layer:
                qkv = qkv + layer["qkv_bias"]
            q = qkv[:, : cfg.q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size]
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size :].reshape(num_tokens, cfg.num_kv_heads,
                                                           cfg.head_dim)
            if "q_norm" in layer:  # Qwen3, Gemma 3: per-head RMSNorm before rope
                q, k = self._norm(q, layer["q_norm"]), self._norm(k, layer["k_norm"])
            q, k = layers.rotate(q, cos, sin), layers.rotate(k, cos, sin)
        else:
            q, k, v = layers.split_rotate(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads)
        out, layer_kv = paged_attention(q, k, v, layer_kv, metadata,
                                        **attention_options)  # [T, heads, D]
        # [T, Q] x [Q, H] -> [T, H]
        out = out.reshape(num_tokens, cfg.q_size)
        out = add_lora(layers.matmul_f32(out, layer["o"], live_rows=live), out, lora, "o", live)
        return self._sublayer_output(out, layer, "o_bias", h.dtype, unrounded), layer_kv

    def _mlp(self, layer, h, live=None, *, unrounded=False, lora=None):
        """The gated MLP of one layer (see `_attention` for `live`, `unrounded`, `lora`)."""
        gate_up = layers.matmul_f32(h, layer["gate_up"], live_rows=live)  # [T, H] x [H, 2I]
        gate_up = add_lora(gate_up, h, lora, "gate_up", live)
        if "gate_up_bias" in layer or self.config.hidden_act != "silu":
            gate_up = gate_up.astype(h.dtype)
            if "gate_up_bias" in layer:
                gate_up = gate_up + layer["gate_up_bias"]
            gate, up = jnp.split(gate_up, 2, axis=-1)
            inner = layers.ACTIVATIONS[self.config.hidden_act](gate) * up
        else:
            inner = layers.silu_mul(gate_up, h.dtype)
        out = layers.matmul_f32(inner, layer["down"], live_rows=live)  # [T, I] x [I, H] -> [T, H]
        out = add_lora(out, inner, lora, "down", live)
        return self._sublayer_output(out, layer, "down_bias", h.dtype, unrounded)


def layer_loras(params: Params) -> list[tuple[dict, jax.Array] | None]:
    """Per layer, (its LoRA stacks, the tokens' slots) when the step runs adapters
    (params["lora"]), else None."""
    lora = params.get("lora")
    if lora is None:
        return [None] * len(params["layers"])
    return [(stacks, lora["slots"]) for stacks in lora["layers"]]


def add_lora(out: jax.Array, x: jax.Array, lora: tuple[dict, jax.Array] | None, target: str,
             live: jax.Array | None) -> jax.Array:
    """A projection's float32 output `out` of input `x`, plus its tokens' LoRA deltas."""
    if lora is None:
        return out
    stacks, slots = lora
    return layers.lora_matmul(out, x, stacks[f"{target}_a"], stacks[f"{target}_b"], slots,
                              live_rows=live)


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The expected shape of every param, as a pytree of tuples (the loaders check against it)."""
    h, i, q, k, d = (config.hidden_size, config.intermediate_size, config.q_size,
                     config.kv_size, config.head_dim)
    layer: dict[str, tuple[int, ...]] = {
        "attn_norm": (h,), "qkv": (h, q + 2 * k), "o": (q, h),
        "mlp_norm": (h,), "gate_up": (h, 2 * i), "down": (i, h),
    }
    if config.qkv_bias:
        layer["qkv_bias"] = (q + 2 * k,)
    if config.o_bias:
        layer["o_bias"] = (h,)
    if config.qk_norm:
        layer["q_norm"] = (d,)
        layer["k_norm"] = (d,)
    if config.mlp_bias:
        layer["gate_up_bias"] = (2 * i,)
        layer["down_bias"] = (h,)
    shapes: dict[str, Any] = {
        "embed": (config.vocab_size, h),
        "layers": [dict(layer) for _ in range(config.num_layers)],
        "final_norm": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (h, config.vocab_size)
    return shapes


MODEL_CLASS = LlamaModel
