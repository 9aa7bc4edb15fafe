"""The contract a served model meets, and `validate_model`, which checks it at `LLM(...)`.

Any model object the engine serves (`LLM(model=obj, params=...)`) exposes:

* `config`, with the fields in `REQUIRED_CONFIG_FIELDS` (positive ints) and optionally
  `sliding_window` (None or a positive int) with `layer_types` (per layer
  "full_attention" or "sliding_attention"; every layer is sliding when it is absent),
  `eos_token_ids` (ints in [0, vocab_size)) and `num_heads` (a multiple of `num_kv_heads`);
* `forward(params, token_ids, positions, kv_pool, metadata) -> (logits, kv_pool)`: a pure
  function of its arguments whose attention layers call
  `jaxpage.attention.paged_attention(q, k, v, kv_pool[layer], metadata)`, the sliding layers
  with `sliding_window=config.sliding_window`: the engine keeps their K/V in a pool of its
  own that holds only each sequence's window (`jaxpage.engine.kv_groups`), so a sliding
  layer that attended further back would read blocks already handed to other sequences.

The engine passes the model object to `jax.jit` as a static argument, so it must be hashable
and compare by value (a frozen dataclass); `params` is a traced pytree of arrays. The KV pool
is a list of `config.num_layers` `(k_pool, v_pool)` pairs, each
`[num_kv_heads, num_blocks, block_size, head_dim]`, and is donated: `forward` returns the
updated pool with the same structure, shapes and dtypes. See `examples/flax_nnx_decoder.py`
for a Flax NNX model served this way and `examples/low_level_loop.py` for the cache without
the engine.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention import AttentionMetadata, LayerKV, build_metadata
from jaxpage.models.config import LAYER_TYPES
from jaxpage.validation import is_positive_int

# Config fields the engine reads; each must be an int >= 1.
REQUIRED_CONFIG_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size",
                          "max_position_embeddings")

# The dummy step `validate_model` traces: two sequences, 2 and 1 new tokens (T = 3), logits
# for the last token of each (R = 2, so a forward that ignores logits_indices is caught),
# each sequence in its own block of a 3-block pool (block 0 is reserved).
_BLOCK_SIZE = 16
_NUM_BLOCKS = 3


@runtime_checkable
class ServedModelConfig(Protocol):
    """What the engine reads from `model.config` (optional: `sliding_window`, `eos_token_ids`).

    num_layers: number of (k_pool, v_pool) pairs in the KV pool.
    num_kv_heads, head_dim: the pool is [num_kv_heads, num_blocks, block_size, head_dim].
    vocab_size: logits are [R, vocab_size]; prompt token ids must be below it.
    max_position_embeddings: the longest sequence (prompt + output) the engine admits.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


@runtime_checkable
class ServedModel(Protocol):
    """A model the engine can serve. Hashable and equal by value (a jit static argument)."""

    config: ServedModelConfig

    def forward(
        self,
        params: Any,
        token_ids: jax.Array,
        positions: jax.Array,
        kv_pool: list[LayerKV],
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, list[LayerKV]]:
        """One ragged, token-flat step.

        Args:
          params: pytree of arrays (traced).
          token_ids, positions: [T] int32.
          kv_pool: per layer (k_pool, v_pool), each [num_kv_heads, num_blocks, block_size,
            head_dim]; donated.
          metadata: the step's AttentionMetadata, passed unchanged to `paged_attention`.

        Returns:
          (logits [R, vocab_size] (float32 recommended) for the rows metadata.logits_indices,
           or [T, vocab_size] when it is None; the updated kv_pool, same structure and shapes).
        """
        ...


def validate_model(model: Any, params: Any) -> None:
    """Refuse, with a ValueError naming what is wrong, a model that breaks the protocol.

    Checks, in order: `config` and a callable `forward` taking the five arguments exist; the
    config fields are present, positive and consistent; the model is hashable; `params` is a
    non-empty pytree of arrays (no PRNG keys); then an abstract trace (`jax.eval_shape`, nothing
    compiled or run) of `forward` on a 3-token dummy step checks the logits shape and that the
    returned KV pool matches the one given. A model whose attention writes more KV heads
    than `config.num_kv_heads` fails inside `paged_attention`; that error is re-raised as a
    ValueError naming the pool's shape.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model {name} has no `config` (the engine reads "
                         f"{', '.join(REQUIRED_CONFIG_FIELDS)})")
    _check_forward_signature(model, name)
    _check_config(config, name)
    try:
        hash(model)
    except TypeError as e:
        raise ValueError(f"model {name} must be hashable: the engine passes it to jax.jit as a "
                         f"static argument (use @dataclasses.dataclass(frozen=True)); {e}") from e
    _check_params(params)
    _check_forward_trace(model, params, config, name)


def _check_forward_signature(model: Any, name: str) -> None:
    forward = getattr(model, "forward", None)
    if not callable(forward):
        raise ValueError(f"model {name} has no `forward(params, token_ids, positions, kv_pool, "
                         "metadata)` method")
    try:
        inspect.signature(forward).bind(*([None] * 5))
    except TypeError as e:
        raise ValueError(f"model {name}.forward must take (params, token_ids, positions, "
                         f"kv_pool, metadata): {e}") from e
    except ValueError:  # no signature available (some builtins): leave it to the trace
        pass


def _check_config(config: Any, name: str) -> None:
    missing = [f for f in REQUIRED_CONFIG_FIELDS if not hasattr(config, f)]
    if missing:
        raise ValueError(f"model {name}.config ({type(config).__name__}) is missing "
                         f"{', '.join(missing)}; the engine reads "
                         f"{', '.join(REQUIRED_CONFIG_FIELDS)}")
    for field in REQUIRED_CONFIG_FIELDS:
        value = getattr(config, field)
        if not is_positive_int(value):
            raise ValueError(f"model {name}.config.{field} must be an integer >= 1, got {value!r}")
    window = getattr(config, "sliding_window", None)
    if window is not None and not is_positive_int(window):
        raise ValueError(f"model {name}.config.sliding_window must be None or an integer >= 1, "
                         f"got {window!r}")
    types = getattr(config, "layer_types", None)
    if types is not None and (isinstance(types, str) or not hasattr(types, "__len__")
                              or len(types) != config.num_layers
                              or not set(types) <= set(LAYER_TYPES)):
        raise ValueError(f"model {name}.config.layer_types must be None or num_layers="
                         f"{config.num_layers} of {LAYER_TYPES}, got {types!r}")
    if types is not None and "sliding_attention" in types and window is None:
        raise ValueError(f"model {name}.config.layer_types has sliding layers but "
                         "sliding_window is None")
    num_heads = getattr(config, "num_heads", None)
    if num_heads is not None and (not is_positive_int(num_heads)
                                  or num_heads % config.num_kv_heads):
        raise ValueError(f"model {name}.config.num_heads ({num_heads!r}) must be a positive "
                         f"multiple of num_kv_heads ({config.num_kv_heads})")
    eos = getattr(config, "eos_token_ids", None) or ()
    try:
        eos = tuple(eos)
    except TypeError:
        raise ValueError(f"model {name}.config.eos_token_ids must be a sequence of ints, "
                         f"got {eos!r}") from None
    for token in eos:
        if not (isinstance(token, int | np.integer) and 0 <= token < config.vocab_size):
            raise ValueError(f"model {name}.config.eos_token_ids must be ints in "
                             f"[0, vocab_size={config.vocab_size}), got {token!r}")


def _check_params(params: Any) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ValueError("params must be a pytree of arrays, got one with no leaves")
    for path, leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            where = f"params{jax.tree_util.keystr(path)}"
            raise ValueError(f"params must be a pytree of arrays; {where} is a "
                             f"{type(leaf).__name__}")
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            # the engine casts every leaf to its dtype (float32/bfloat16); a key cannot be
            raise ValueError(f"params{jax.tree_util.keystr(path)} is a PRNG key array; serve "
                             "weights only (e.g. build the module without nnx.Rngs-holding "
                             "layers such as Dropout, or split out the nnx.Param state)")


def _check_forward_trace(model: Any, params: Any, config: Any, name: str) -> None:
    dtype = next((leaf.dtype for leaf in jax.tree.leaves(params)
                  if jnp.issubdtype(leaf.dtype, jnp.floating)), jnp.float32)
    pool_shape = (config.num_kv_heads, _NUM_BLOCKS, _BLOCK_SIZE, config.head_dim)
    layer = jax.ShapeDtypeStruct(pool_shape, dtype)
    kv_pool = [(layer, layer) for _ in range(config.num_layers)]
    positions, metadata = build_metadata([[1], [2]], [0, 0], [2, 1], _BLOCK_SIZE)
    token_ids = np.zeros(positions.shape, np.int32)
    num_rows = metadata.logits_indices.shape[0]
    step = (f"a dummy step of {token_ids.shape[0]} tokens in 2 sequences with a KV pool of "
            f"{config.num_layers} layers of (k, v) each {list(pool_shape)} "
            "[num_kv_heads, num_blocks, block_size, head_dim]")
    try:
        out = jax.eval_shape(model.forward, params, token_ids, positions, kv_pool, metadata)
    except Exception as e:  # any failure of the user's forward is reported
        raise ValueError(
            f"model {name}.forward failed on {step}: {type(e).__name__}: {e}\n(does its "
            f"attention produce config.num_kv_heads={config.num_kv_heads} KV heads of "
            f"config.head_dim={config.head_dim}, and its stack config.num_layers="
            f"{config.num_layers} layers?)") from e
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ValueError(f"model {name}.forward must return (logits, kv_pool), got "
                         f"{type(out).__name__}")
    logits, new_pool = out
    expected = (num_rows, config.vocab_size)
    if tuple(getattr(logits, "shape", ())) != expected:
        raise ValueError(
            f"model {name}.forward returned logits of shape {getattr(logits, 'shape', None)} on "
            f"{step}; expected [R, vocab_size] = {list(expected)}: one row per entry of "
            "metadata.logits_indices")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"model {name}.forward returned logits of dtype {logits.dtype}; "
                         "expected a floating dtype (float32)")
    given = jax.tree.structure(kv_pool)
    returned = jax.tree.structure(new_pool)
    if returned != given:
        raise ValueError(f"model {name}.forward returned a kv_pool structured as {returned}; "
                         f"expected the structure it was given, a list of config.num_layers="
                         f"{config.num_layers} (k_pool, v_pool) pairs: {given}")
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(new_pool)[0],
                                 jax.tree.leaves(kv_pool), strict=True):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(
                f"model {name}.forward returned kv_pool{jax.tree_util.keystr(path)} of "
                f"{got.dtype}{list(got.shape)}; expected {want.dtype}{list(want.shape)} "
                f"(config.num_kv_heads={config.num_kv_heads}, head_dim={config.head_dim})")
