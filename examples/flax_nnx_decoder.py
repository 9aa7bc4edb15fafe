"""Serve a Flax NNX decoder with jaxpage: the model calls `paged_attention`, the engine the rest.

The decoder below is written the way a researcher writes one: `nnx.Module` classes for the
embedding, RMSNorm, rotary embedding, attention and MLP, initialised at random from
`nnx.Rngs`. The only jaxpage-specific line is in `Attention.__call__`, which hands its rotated
q/k/v and its layer's slice of the KV pool to `jaxpage.attention.paged_attention`.

To serve it, the module is split with `nnx.split` into

* `graphdef`: the module's structure (classes, static attributes). Hashable and compared by
  value, so it can sit inside the model object that the engine passes to `jax.jit` as a
  static argument;
* `state`: an `nnx.State` pytree of the weights. It travels as the traced `params` argument
  of the engine's jitted step (never closed over, never static).

`NNXModel(graphdef, config)` is the adapter the engine sees: a frozen dataclass with `config`
and `forward(params, token_ids, positions, kv_pool, metadata)`, which `nnx.merge`s the graphdef
with the traced state and calls the module.

    python examples/flax_nnx_decoder.py
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpage import LLM, SamplingParams
from jaxpage.attention import AttentionMetadata, LayerKV, paged_attention


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes of the decoder. The engine reads num_layers, num_kv_heads, head_dim, vocab_size,
    max_position_embeddings and (optionally) eos_token_ids; the rest is the model's own."""

    vocab_size: int = 101
    hidden_size: int = 48
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 12
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    eos_token_ids: tuple[int, ...] = ()


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * x32.astype(x.dtype)


class RotaryEmbedding(nnx.Module):
    """Half-split ("rotate_half") rotary embedding; no weights, only static attributes."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim = head_dim
        self.theta = theta

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        # x: [T, heads, D]; positions: [T]
        exponent = jnp.arange(0, self.head_dim, 2, dtype=jnp.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)  # [D/2]
        freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
        angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, D]
        half = self.head_dim // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nnx.Linear(h, cfg.num_heads * cfg.head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(h, cfg.num_kv_heads * cfg.head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(h, cfg.num_kv_heads * cfg.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(cfg.num_heads * cfg.head_dim, h, use_bias=False, rngs=rngs)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def __call__(self, x: jax.Array, positions: jax.Array, layer_kv: LayerKV,
                 metadata: AttentionMetadata) -> tuple[jax.Array, LayerKV]:
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.rope(q, positions), self.rope(k, positions)
        # The jaxpage seam: write this step's K/V into the pool, attend over the cache.
        out, layer_kv = paged_attention(q, k, v, layer_kv, metadata)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1)), layer_kv


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate = nnx.Linear(h, i, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(h, i, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(i, h, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, layer_kv, metadata):
        attn_out, layer_kv = self.attn(self.attn_norm(x), positions, layer_kv, metadata)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), layer_kv


class Decoder(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_pool: list[LayerKV],
                 metadata: AttentionMetadata) -> tuple[jax.Array, list[LayerKV]]:
        """token_ids, positions: [T] int32 -> (logits [R, vocab] float32, updated kv_pool)."""
        x = self.embed(token_ids)  # [T, H]
        new_pool = []
        for layer, layer_kv in zip(self.layers, kv_pool, strict=True):
            x, layer_kv = layer(x, positions, layer_kv, metadata)
            new_pool.append(layer_kv)
        x = self.final_norm(x)
        if metadata.logits_indices is not None:  # only the rows whose next token is drawn
            x = x[metadata.logits_indices]  # [R, H]
        return self.lm_head(x).astype(jnp.float32), new_pool


@dataclasses.dataclass(frozen=True)
class NNXModel:
    """The adapter the engine serves: hashable (graphdef and config compare by value), so it
    can be a static argument of `jax.jit`; the weights come in as the traced `params`."""

    graphdef: nnx.GraphDef
    config: DecoderConfig
    # jit hashes its static arguments on every call; hashing a graphdef walks every node
    # (~0.1 ms per layer), so the hash is computed once here.
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.graphdef, self.config)))

    def __hash__(self) -> int:
        return self._hash

    def forward(self, params: nnx.State, token_ids: jax.Array, positions: jax.Array,
                kv_pool: list[LayerKV], metadata: AttentionMetadata):
        module = nnx.merge(self.graphdef, params)  # a module over the traced weights
        return module(token_ids, positions, kv_pool, metadata)


def build(config: DecoderConfig = DecoderConfig(), seed: int = 0) -> tuple[NNXModel, nnx.State]:
    """A randomly initialised decoder, split into (the served model, its params)."""
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))
    return NNXModel(graphdef, config), state


def main() -> None:
    model, params = build()
    llm = LLM(model=model, params=params, max_num_seqs=8, num_blocks=64, block_size=8,
              max_num_batched_tokens=128, enable_prefix_caching=True)
    system = list(range(10, 34))  # a 24-token prefix shared by the second batch
    first = [system + [40, 41, 42], [5, 6, 7, 8, 9], [77]]
    second = [system + [50, 51], system + [60, 61, 62, 63, 64, 65]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    for batch in (first, second):  # the second batch reuses the first one's cached prefix
        for out in llm.generate(batch, greedy, use_tqdm=False):
            print(f"prompt {out.prompt_token_ids} -> {out.outputs[0].token_ids}")
    stats = llm.stats()
    print(f"prefix-cache hits: {stats['prefix_cache_hits']} of "
          f"{stats['prefix_cache_queries']} prompt tokens; compiles: {stats['compiles']}")


if __name__ == "__main__":
    main()
