"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) as pure functions.

Params are a plain pytree with one dict per layer (separate arrays per layer: slicing
layers out of stacked arrays inside the jitted step costs far more than it saves on CPU):

    {"embed": [V, H],
     "layers": [{"attn_norm": [H], "qkv": [H, Q + 2K], "o": [Q, H],
                 "mlp_norm": [H], "gate_up": [H, 2I], "down": [I, H],
                 # optional, by architecture:
                 "qkv_bias": [Q + 2K], "o_bias": [H], "q_norm": [D], "k_norm": [D],
                 "gate_up_bias": [2I], "down_bias": [H]}, ...],
     "final_norm": [H],
     "lm_head": [H, V]}            # absent when embeddings are tied

with Q = num_heads * head_dim, K = num_kv_heads * head_dim. Weights are stored
[in, out] (transposed from HF's nn.Linear layout) and q/k/v and gate/up are fused so a
layer runs three matmuls instead of seven.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxpage.attention import AttentionMetadata, LayerKV, paged_attention
from jaxpage.models.config import ModelConfig, RopeConfig, rope_inv_freq
from pallas_kernels import bits, cpu_ops

Params = dict[str, Any]

# the gated MLP's activation by HF name (ModelConfig.hidden_act); gelu_pytorch_tanh is
# torch's gelu(approximate="tanh")
ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def linear(x: jax.Array, w: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
    """x @ w accumulated in float32 and rounded once to x's dtype (as PyTorch's bfloat16
    matmuls do). For bfloat16 this is also XLA:CPU's fast path: a bfloat16 dot with a
    bfloat16 result runs ~4x slower there than one with a float32 result (SmolLM2's [16, 576]
    x [576, 1536] projection: 1.10 ms vs 0.28 ms; float32 inputs: 0.21 ms). `live_rows`: x's
    rows past it are a shape bucket's padding, whose products a packed weight leaves as zeros
    (see `_matmul_f32`)."""
    return _matmul_f32(x, w, live_rows=live_rows).astype(x.dtype)


# rows up to which a CPU matmul takes the kernel library's small_matmul (decode steps and
# short chunks), by dtype and weight layout ([K, N]: the projections; [N, K]: a tied LM head):
# where it beat XLA:CPU's dot in every run on SmolLM2's shapes (scripts/bench_small_matmul.py
# --vs-xla; docs/bench/cpu_small_matmul_vs_xla_2026-12-01.log). bfloat16, a step's 121
# matmuls: 8 rows 1.85x, 32 rows 1.14x, 48 rows 0.9-1.1x across runs (the projections 0.9x in
# that log); the head alone 16 rows 1.02-1.17x, 24 rows 0.93-1.03x. float32 projections 32
# rows 53.9 vs 57.5 ms, 48 rows 74.4 vs 69.8; float32 head 16 rows 9.2 vs 10.8, 24 rows 14.8
# vs 14.4.
SMALL_MATMUL_ROWS = {("bfloat16", False): 32, ("bfloat16", True): 16,
                     ("float32", False): 32, ("float32", True): 16}


# the projections `pack_params` packs for the CPU kernel's packed matmul
PACKED_WEIGHTS = ("qkv", "o", "gate_up", "down")

# a layer the CPU kernel library runs in one call (`cpu_ops.decoder_layer`): these params
# (no biases, no q/k norms), its projections packed
FUSED_LAYER_PARAMS = frozenset(("attn_norm", "mlp_norm") + PACKED_WEIGHTS)
# steps of at most this many tokens (decode) run such layers in one call each on CPU
FUSED_LAYER_ROWS = 8


def pack_params(params: Params) -> Params:
    """The params with each layer's projections (PACKED_WEIGHTS) and the LM head (`lm_head`, or
    a tied `embed` as [H, V]), where `cpu_ops.packable` (float32 or bfloat16, N a
    multiple of the build's panel width: 32 columns with AVX-512, else 16), packed by
    `cpu_ops.pack_weight`: the layout a CPU runner keeps them in, so that every matmul
    of them, decode and prefill alike, streams its weights in order
    (`cpu_ops.packed_matmul`; a 1-8 row step ~25% faster than on the [K, N] walk, and
    from 64 to 256 rows 1.1-2x XLA's dot, 0.94x bfloat16 / 1.04x float32 at 1024). `linear`,
    `embed` and `compute_logits` take packed weights as they take the others; the engine packs
    only where the kernel library is available."""
    pack = cpu_ops.pack_weight  # NumPy params pack on the host; the others are kept
    layers = [{name: pack(w) if name in PACKED_WEIGHTS and cpu_ops.packable(w) else w
               for name, w in layer.items()} for layer in params["layers"]]
    out = dict(params, layers=layers)
    if "lm_head" in params:
        if cpu_ops.packable(params["lm_head"]):
            out["lm_head"] = pack(params["lm_head"])
    elif cpu_ops.packable(params["embed"].T):
        # a tied head: the embedding table [V, H] packed as the head's [H, V] (`embed` reads
        # its rows back out of the panels)
        out["embed"] = pack(params["embed"].T)
    return out


def _matmul_f32(x: jax.Array, w: jax.Array, *, transpose_w: bool = False,
                live_rows: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ w ([K, N], or [N, K] with `transpose_w`) -> float32 [M, N]. A packed weight
    (`pack_params`: 4-D, only ever on CPU) goes through `cpu_ops.packed_matmul`, any M.
    Otherwise, on CPU, for float32/bfloat16 operands of one dtype and M up to its
    SMALL_MATMUL_ROWS, through `cpu_ops.small_matmul` where the kernel library is built
    for AVX-512 (XLA:CPU's matmuls stream the weights at about half the read bandwidth with so
    few rows; without AVX-512 the walks lose to XLA: `cpu_ops.wide_vectors`); elsewhere,
    and on every other platform, jnp's dot. Only the packed path reads `live_rows` (x's rows
    past it are padding): it multiplies only the live rows, the others are zeros there and
    whatever the dot gives elsewhere; no one reads them."""
    if w.ndim == 4:
        return cpu_ops.packed_matmul(x, w, live_rows=live_rows)

    def dot(x, w):
        if transpose_w:
            return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    dtype = jnp.dtype(x.dtype)
    if (x.ndim != 2 or w.ndim != 2 or dtype != jnp.dtype(w.dtype)
            or x.shape[0] > SMALL_MATMUL_ROWS.get((dtype.name, transpose_w), 0)
            or not cpu_ops.wide_vectors()):  # built, and for AVX-512
        return dot(x, w)

    def kernel(x, w):
        return cpu_ops.small_matmul(x, w, transpose_w=transpose_w)

    # only XLA:CPU takes the kernel; accelerators lower the dot as before
    return jax.lax.platform_dependent(x, w, cpu=kernel, default=dot)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False
             ) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back (as HF does).

    With `unit_offset` (Gemma) the scale is 1 + weight, and HF applies it in float32
    before the cast rather than after it (Llama casts, then multiplies by the weight).
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def _cpu_glue(cpu, default, *args):
    """`default(*args)`, or `cpu(*args)` (a kernel library call) on CPU where the library is
    built: a layer's elementwise glue, which XLA:CPU runs as several loop fusions (split over
    its threads from 8 rows on, ~5-20 us each for a few KB)."""
    if not cpu_ops.available():
        return default(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def _glue_dtype(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float
                 ) -> tuple[jax.Array, jax.Array]:
    """(s, rms_norm(s, weight, eps)) with s = x + delta.astype(x.dtype) (x without delta): a
    residual add (delta: a sublayer's output, float32 before rounding or x's dtype) and the
    norm after it, for x [T, H]. On CPU one kernel call (`cpu_ops.add_rms_norm`: the same
    sum bit for bit, the norm to float32 rounding of rms_norm's)."""
    def default(x, delta, weight):
        s = x if delta is None else x + delta.astype(x.dtype)
        return s, rms_norm(s, weight, eps)

    if x.ndim != 2 or not _glue_dtype(x.dtype) or weight.dtype != x.dtype:
        return default(x, delta, weight)
    return _cpu_glue(functools.partial(cpu_ops.add_rms_norm, eps=eps), default,
                     x, delta, weight)


def silu_mul(gate_up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up in `dtype` for gate_up [T, 2I] = [gate | up] (float32 before rounding,
    or `dtype`), as the MLP computes them. On CPU one kernel call (`cpu_ops.silu_mul`:
    silu in float32 rounded once, as HF's bfloat16 silu; XLA rounds each of its ops)."""
    def default(gate_up):
        gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
        return jax.nn.silu(gate) * up

    if gate_up.ndim != 2 or not _glue_dtype(dtype):
        return default(gate_up)
    return _cpu_glue(functools.partial(cpu_ops.silu_mul, dtype=dtype), default, gate_up)


def split_rotate(qkv: jax.Array, cos: jax.Array, sin: jax.Array, num_heads: int,
                 num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, heads, D], k and v [T, kv_heads, D] in cos's dtype from the fused projection's
    qkv [T, (heads + 2 kv_heads) D] (float32 before rounding, or that dtype), q and k rotated
    (`rotate`). On CPU one kernel call (`cpu_ops.qkv_rope`, bit for bit this)."""
    dim = cos.shape[-1]

    def default(qkv, cos, sin):
        qkv = qkv.astype(cos.dtype)
        q = qkv[:, : num_heads * dim].reshape(-1, num_heads, dim)
        k = qkv[:, num_heads * dim : (num_heads + num_kv_heads) * dim]
        v = qkv[:, (num_heads + num_kv_heads) * dim :]
        return (rotate(q, cos, sin), rotate(k.reshape(-1, num_kv_heads, dim), cos, sin),
                v.reshape(-1, num_kv_heads, dim))

    if qkv.ndim != 2 or not _glue_dtype(cos.dtype) or sin.dtype != cos.dtype or dim % 2:
        return default(qkv, cos, sin)
    return _cpu_glue(functools.partial(cpu_ops.qkv_rope, num_heads=num_heads,
                                       num_kv_heads=num_kv_heads), default, qkv, cos, sin)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding in the half-split ("rotate_half") convention.

    x: [T, heads, D]; cos, sin: [T, D] already in x's dtype.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_cos_sin(config: ModelConfig, positions: jax.Array, dtype,
                 rope: RopeConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [T, head_dim] for the given positions [T], of `rope` (default
    config.rope; Gemma 3's sliding layers have a rope of their own)."""
    rope = config.rope if rope is None else rope
    inv_freq = jnp.asarray(rope_inv_freq(config.head_dim, rope))  # [D/2] float32
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


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

    def with_tensor_parallel(self, local_config: ModelConfig, axis: str) -> LlamaModel:
        return dataclasses.replace(self, config=local_config, tp_axis=axis)

    def pack_params(self, params: Params) -> Params:
        """The params as a CPU runner keeps them: see the module-level `pack_params`."""
        return pack_params(params)

    def _all_reduce(self, x: jax.Array) -> jax.Array:
        return x if self.tp_axis is None else jax.lax.psum(x, self.tp_axis)

    def embed(self, params: Params, token_ids: jax.Array) -> jax.Array:
        """[T] ids -> [T, H]; tensor-parallel, each device looks up the ids in its vocabulary
        range and the partial rows are summed. A table packed as a tied head (`pack_params`:
        [V / P, ceil(H / G), P, G], P columns a panel) gives id v's row from panel v // P,
        column v % P."""
        table = params["embed"]
        if table.ndim == 4:
            panel = table.shape[2]  # the packing's panel width (the build's)
            # [T, ceil(H / G), G], gathered as bits (XLA:CPU would convert a bfloat16 table
            # whole to gather from it)
            rows = bits.take(table, (token_ids // panel, slice(None), token_ids % panel,
                                     slice(None)))
            return rows.reshape(token_ids.shape[0], -1)[:, : self.config.hidden_size]
        if self.tp_axis is None:
            return bits.take(table, token_ids)
        rows = table.shape[0]
        local = token_ids - jax.lax.axis_index(self.tp_axis) * rows
        mine = (local >= 0) & (local < rows)
        x = jnp.where(mine[:, None], bits.take(table, jnp.clip(local, 0, rows - 1)), 0)
        return jax.lax.psum(x, self.tp_axis)

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
        layers = params["layers"]
        # each residual add is fused with the norm after it (`add_rms_norm`): the next
        # sublayer's input norm, and after the last layer the final norm
        next_norms = [layer["attn_norm"] for layer in layers[1:]] + [params["final_norm"]]
        x, h = self._add_norm(x, None, layers[0]["attn_norm"])
        for layer, layer_kv, window, next_norm in zip(layers, kv_pool, cfg.layer_windows,
                                                      next_norms, strict=True):
            if window is None and self._fused(layer, layer_kv, next_norm, x, metadata):
                x, h, *layer_kv = cpu_ops.decoder_layer(
                    x, h, layer, cos, sin, *layer_kv, metadata.slot_mapping,
                    metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                    next_norm, num_heads=cfg.num_heads, eps=cfg.rms_norm_eps, live_rows=live)
                new_pool.append(tuple(layer_kv))
                continue
            options = {} if window is None else {"sliding_window": window}  # Mistral
            attn_out, layer_kv = self._attention(layer, h, cos, sin, layer_kv, metadata, live,
                                                 unrounded=True, **options)
            x, h = self._add_norm(x, attn_out, layer["mlp_norm"])
            x, h = self._add_norm(x, self._mlp(layer, h, live, unrounded=True), next_norm)
            new_pool.append(layer_kv)
        return self._logits(params, h, metadata), new_pool

    def _fused(self, layer, layer_kv, next_norm, x: jax.Array, metadata: AttentionMetadata
               ) -> bool:
        """Whether this layer runs as one CPU kernel call (`cpu_ops.decoder_layer`, bit
        for bit the unfused calls): a step of at most FUSED_LAYER_ROWS tokens on the C++
        backend, a plain layer (FUSED_LAYER_PARAMS, its projections packed, SiLU), float32 or
        bfloat16 throughout (pools included: not quantized, not padded past head_dim), one
        device. Its eleven calls (matmuls, glue, pool writes, attention) each schedule their
        helper threads and start their weight stream anew: in one call a decode step of
        SmolLM2 at context 128 ran 1.05x / 1.04x / 1.04x / 1.02x faster at 1 / 2 / 4 / 8 rows
        in bfloat16, 1.02-0.99x in float32 (scripts/bench_decode_step.py --vs-unfused)."""
        dtype = x.dtype
        return (self.fuse_layers and self.tp_axis is None and metadata.backend == "cpp"
                and x.shape[0] <= FUSED_LAYER_ROWS and _glue_dtype(dtype)
                and self.config.hidden_act == "silu" and set(layer) == FUSED_LAYER_PARAMS
                and all(layer[name].ndim == 4 and layer[name].dtype == dtype
                        for name in PACKED_WEIGHTS)
                and layer["mlp_norm"].dtype == dtype and next_norm.dtype == dtype
                and all(isinstance(pool, jax.Array) and pool.dtype == dtype
                        and pool.shape[-1] == self.config.head_dim for pool in layer_kv)
                and cpu_ops.available())

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
        config says so: Gemma 2); rows past `live_rows` are padding (see `linear`)."""
        if "lm_head" in params:
            # [R, H] x [H, V] -> [R, V]
            logits = _matmul_f32(hidden, params["lm_head"], live_rows=live_rows)
        elif params["embed"].ndim == 4:  # tied, packed as the head [H, V] (pack_params)
            logits = _matmul_f32(hidden, params["embed"], live_rows=live_rows)
        else:  # tied: [R, H] x [V, H]^T -> [R, V]
            logits = _matmul_f32(hidden, params["embed"], transpose_w=True)
        if self.tp_axis is not None:
            # each device has its vocabulary range: gather them, drop the padding
            logits = jax.lax.all_gather(logits, self.tp_axis, axis=1, tiled=True)
            logits = logits[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def _norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(self, x: jax.Array, delta: jax.Array | None, weight: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
        """(x + delta in x's dtype, its norm): `add_rms_norm`, one kernel call on CPU."""
        return add_rms_norm(x, delta, weight, self.config.rms_norm_eps)

    def _sublayer_output(self, out: jax.Array, layer, bias: str, dtype, unrounded: bool
                         ) -> jax.Array:
        """A sublayer's last matmul's float32 output as the residual stream takes it: left
        unrounded for the caller's add (`add_rms_norm` rounds it) where nothing comes between,
        else rounded to `dtype`, all-reduced and biased."""
        if unrounded and self.tp_axis is None and bias not in layer:
            return out
        out = self._all_reduce(out.astype(dtype))
        return out + layer[bias] if bias in layer else out

    def _attention(self, layer, h, cos, sin, layer_kv, metadata, live=None, *,
                   unrounded=False, **attention_options):
        """Attention of one layer; `live`: the step's tokens (`linear`'s live_rows);
        `attention_options` go to `paged_attention` (scale, sliding_window, soft_cap). With
        `unrounded`, the output may be the o projection's float32 (`_sublayer_output`)."""
        cfg = self.config
        num_tokens = h.shape[0]
        # [T, H] x [H, Q + 2K] -> [T, Q + 2K], float32
        qkv = _matmul_f32(h, layer["qkv"], live_rows=live)
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
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        else:
            q, k, v = split_rotate(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads)
        out, layer_kv = paged_attention(q, k, v, layer_kv, metadata,
                                        **attention_options)  # [T, heads, D]
        # [T, Q] x [Q, H] -> [T, H]
        out = _matmul_f32(out.reshape(num_tokens, cfg.q_size), layer["o"], live_rows=live)
        return self._sublayer_output(out, layer, "o_bias", h.dtype, unrounded), layer_kv

    def _mlp(self, layer, h, live=None, *, unrounded=False):
        """The gated MLP of one layer (see `_attention` for `live` and `unrounded`)."""
        gate_up = _matmul_f32(h, layer["gate_up"], live_rows=live)  # [T, H] x [H, 2I]
        if "gate_up_bias" in layer or self.config.hidden_act != "silu":
            gate_up = gate_up.astype(h.dtype)
            if "gate_up_bias" in layer:
                gate_up = gate_up + layer["gate_up_bias"]
            gate, up = jnp.split(gate_up, 2, axis=-1)
            inner = ACTIVATIONS[self.config.hidden_act](gate) * up
        else:
            inner = silu_mul(gate_up, h.dtype)
        out = _matmul_f32(inner, layer["down"], live_rows=live)  # [T, I] x [I, H] -> [T, H]
        return self._sublayer_output(out, layer, "down_bias", h.dtype, unrounded)


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
