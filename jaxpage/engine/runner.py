"""Host -> device: pack a step into padded arrays of bucketed shapes and run the jitted step.

The runner knows nothing about requests: it is given, per sequence, its block table, how
many tokens are cached, the new token ids and (when a token is to be drawn) its sampling
row. With the jnp and Pallas backends each step runs as at most two calls of one jitted
function: the decode tokens (one new token per sequence, `max_query_len` 1) and the prefill
chunks (several tokens per sequence), so the attention of a decode batch never pays for the
longest prompt chunk. The C++ kernel ("cpp") costs each sequence only its own tokens, so a
step mixing both runs as one call.

Every array dimension is padded to a bucket (powers of two; decode batches also at the
1.5x points between them from 8 rows on), so the number of compilations
over any trace is bounded by `max_compiles`; `compiles` counts them as they happen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpage import lora as lora_layout
from jaxpage.attention import (
    RAGGED_BACKENDS,
    build_metadata,
    init_kv_pool,
    kv_bytes_per_block,
    pool_head_dim,
    select_backend,
)
from jaxpage.buckets import bucket_for, power_of_two_buckets
from jaxpage.engine import device_params, draft_model, executables, huge_pages, kv_sizing
from jaxpage.engine.batch import SeqInput, SeqResult
from jaxpage.engine.host_swap import HostSwaps
from jaxpage.engine.kv_groups import window_host_blocks
from jaxpage.engine.run_ahead import (
    ADVANCE,
    APPEND_HISTORY,
    NEXT_TOKENS,
    PICK_TOKENS,
    Ahead,
    DecodeInputs,
    Served,
    Step,
    ahead_rows,
    fill_history,
    history_slots,
    next_row,
)
from jaxpage.engine.runner_api import RUNNER_PHASES, StepTimer
from jaxpage.engine.speculative import DRAFT_SLOT
from jaxpage.layers import quantized_linear
from jaxpage.models.config import layer_windows
from jaxpage.parallel import TensorParallel, TensorParallelModel
from jaxpage.sampling import SamplingMetadata, sample
from jaxpage.sampling_params import SamplingParams, SamplingRow
from pallas_kernels import bits, lowering, quantized

logger = logging.getLogger("jaxpage.engine")

if TYPE_CHECKING:
    from jaxpage.config import EngineConfig


def _copy_blocks_fn(kv_pool, src, dst):
    # src, dst: [C] int32; padding copies block 0 onto itself
    # pools are [num_kv_heads, num_blocks, block_size, head_dim] (a quantized pool's scales
    # [num_kv_heads, num_blocks, block_size]: every leaf is indexed by block on axis 1)
    return jax.tree.map(lambda x: bits.set_rows(x, dst, bits.take(x, (slice(None), src))),
                        kv_pool)


def _fill_blocks_fn(kv_pool, block_ids, value):
    # block_ids: [C] int32 (padding repeats the first id); value: a float32 scalar (NaN),
    # written to float leaves (a quantized pool's NaN scales poison its slots; int8 values
    # take 0)
    def fill(x):
        v = value if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros((), x.dtype)
        return bits.set_rows(x, block_ids, jnp.broadcast_to(
            v.astype(x.dtype), (x.shape[0], block_ids.shape[0], *x.shape[2:])))

    return jax.tree.map(fill, kv_pool)


def _counted(logits: jax.Array) -> jax.Array:
    """`logits`, bit for bit, through an op XLA:CPU's cost model counts. XLA:CPU runs an
    executable it counts under 1,000 FLOPs inline, on the calling thread, once its inputs are
    ready (PJRT's "cheap computation"), and it counts nothing in a custom call: a float32
    decode step whose every matmul is one of the kernel library's counted 59 to 736 FLOPs,
    so the host waited out each step it dispatched and none of its own work overlapped one
    (a step run ahead included). max(x, -inf) is x (NaN stays NaN) and counts a FLOP per
    logit; the barrier keeps XLA from seeing the -inf and dropping it."""
    return jnp.maximum(logits, jax.lax.optimization_barrier(jnp.array(-jnp.inf, logits.dtype)))


def _forward_fn(model, platform, params, kv_pool, token_ids, positions, attn_md):
    # traced for the runner's platform alone (pallas_kernels.lowering: the kernel library's
    # ops or the jnp ones, not both)
    with lowering.for_platform(platform):
        logits, kv_pool = model.forward(params, token_ids, positions, kv_pool, attn_md)
    return _counted(logits), kv_pool


# Module-level so that every runner of the same model shares compiled executables. The
# forward and the sampler are separate executables: the compile count is then the number of
# batch shapes plus the number of sampling variants, not their product.
_FORWARD = jax.jit(_forward_fn, static_argnums=(0, 1), donate_argnums=3)
_SAMPLE = jax.jit(sample)
_COPY_BLOCKS = jax.jit(_copy_blocks_fn, donate_argnums=0)
_FILL_BLOCKS = jax.jit(_fill_blocks_fn, donate_argnums=0)


def _set_slot_fn(stacks, slot, values):
    """LoRA stacks with slot `slot` of each set to its `values` (`ModelRunner.load_lora`)."""
    return jax.tree.map(lambda stack, value: stack.at[slot].set(value.astype(stack.dtype)),
                        stacks, values)


def build_runner(model: Any, params: Any, config: EngineConfig, *, max_model_len: int,
                 devices: list | None = None, draft: tuple[Any, Any] | None = None) -> Any:
    """The engine's runner: a ModelRunner, whose device calls every process makes together
    when JAX spans several processes (jaxpage.distributed)."""
    runner = ModelRunner(model, params, config, max_model_len=max_model_len, devices=devices,
                         draft=draft)
    if jax.process_count() == 1:
        return runner
    from jaxpage.distributed import MultiHostRunner

    return MultiHostRunner(runner)


class ModelRunner(HostSwaps):
    """Owns the device params, the KV pool, the host pool and the compiled step functions.

    Built from the engine's config: it picks the attention backend for this platform, casts
    the params to the engine dtype and moves them to the device, then sizes the KV pool
    from what is left (`num_blocks`, read by the scheduler's allocator) and the host pool
    from `swap_space` (`num_host_blocks`). The host pool is a numpy array of
    `[num_host_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]`: one
    block's K/V of every layer in one contiguous row. With sliding-window layers it holds
    the full-attention layers' K/V, and `window_host_kv` (`num_window_host_blocks` rows)
    the sliding layers' (jaxpage.engine.kv_groups: its blocks follow the full group's in
    a swap plan's host ids).

    A speculative decoding draft model (`draft`: its model and numpy params, for
    `speculative_config.model`) keeps its K/V in a pool of its own (`draft_pool`, and
    `draft_host_kv` beside the host pool) of the same blocks: block b of a sequence's table
    holds the target's K/V of its tokens in `kv_pool` and the draft's in `draft_pool`.
    Every step the draft computes the K/V of the tokens the target computes, and every
    block copy, fill and swap moves both, so whatever the allocator does with a block (a
    prefix hit, a fork, a preemption, a swap) holds for the draft's K/V too. Its blocks
    are paid for from the same budget: a block costs the target's bytes and the draft's.
    """

    def __init__(self, model: Any, params: Any, config: EngineConfig, *,
                 max_model_len: int, devices: list | None = None,
                 draft: tuple[Any, Any] | None = None) -> None:
        model_config = model.config
        dtype = jnp.dtype(config.dtype)
        # the pool's storage: the model dtype, or a float / 8-bit kv_cache_dtype
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else jnp.dtype(config.kv_cache_dtype)
        self.kv_dtype = kv_dtype
        block_size = config.block_size
        max_num_seqs, max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.model = model
        self.vocab_size = model_config.vocab_size
        self.block_size = block_size
        self.backend = select_backend(config.attention_backend,
                                      interpret=config.kernel_interpret,
                                      head_dim=model_config.head_dim, block_size=block_size,
                                      dtype=kv_dtype)
        self.ragged = self.backend in RAGGED_BACKENDS
        self.interpret = config.kernel_interpret
        params = device_params.cast_params(params, dtype)
        if config.quantize_lm_head:
            params = quantized_linear.quantize_head(params, config.quantization)
        # the params' bytes as loaded (an 8-bit projection's values and scales: jaxpage.layers.
        # quantized_linear), before any device's layout: what the model weighs
        self.weight_bytes = quantized_linear.weight_bytes(params)
        self.quantized_weight_bytes = quantized_linear.weight_bytes(params, quantized_only=True)
        self.quantization = quantized_linear.weight_format(params)
        if self.quantization == "fp8" and (devices or jax.devices())[0].platform == "cpu":
            logger.warning("fp8 weights on a CPU run through XLA's dot, which widens every "
                           "weight each step (a 1-row step ~10x bfloat16's on SmolLM2); int8 "
                           "has a CPU kernel")
        # tensor parallel: the model runs under shard_map on its mesh, each device holding
        # its share of the params and of the pool's KV heads (jaxpage.parallel)
        # `devices` (default: the first tensor_parallel_size) are this runner's alone: a
        # data-parallel replica gets its own
        tp = config.tensor_parallel_size
        devices = list(jax.devices()[:tp] if devices is None else devices)
        self.parallel = None
        pool_kv_heads = model_config.num_kv_heads
        if tp > 1:
            self.parallel = TensorParallel.create(model_config, tp, devices)
            self.model = model = TensorParallelModel.wrap(model, self.parallel)
            self.params = self.parallel.shard_params(params)
            pool_kv_heads = self.parallel.pool_kv_heads
            self._pool_sharding = self.parallel.pool_sharding
            # a step's token ids on the device (a run-ahead step's come from the sampler):
            # on every device of the mesh, as the jitted step takes host arrays
            self._input_sharding = self.parallel.replicated
        else:
            if device_params.packs_weights(model, devices[0], dtype):  # on the host, first
                params = device_params.pack_params(model, params)
            self.params = jax.device_put(params, devices[0])
            self._pool_sharding = jax.sharding.SingleDeviceSharding(devices[0])
            self._input_sharding = self._pool_sharding
        if devices[0].platform == "cpu":
            huge_pages.advise(jax.tree.leaves(self.params))
        self.devices = devices
        # speculative decoding by a draft model (`_fill_drafts`): the target's first
        # draft_layers layers on its pool, or a model of its own on a pool of its own
        self._draft = draft_model.build_draft(model, self.params, config, draft, devices,
                                              self.backend, dtype)
        own = self._draft is not None and self._draft.layers is None
        # the pool's head dim is what the kernel reads in place (padded once, here)
        pool_dim = pool_head_dim(self.backend, model_config.head_dim)
        # KV groups (jaxpage.engine.kv_groups): sliding-window layers keep their K/V in a
        # window group's pool of its own, whose blocks leave a sequence with its window
        # (a window as long as the longest sequence never binds: no window group then)
        windows = [w if w and w < max_model_len else None for w in layer_windows(model_config)]
        if len({w for w in windows if w}) > 1:
            raise ValueError(f"layers with different sliding windows "
                             f"{sorted(set(windows) - {None})} are not supported (one window "
                             "group)")
        self.window = next((w for w in windows if w), None)
        self.window_layers = [i for i, w in enumerate(windows) if w]
        self.full_layers = [i for i, w in enumerate(windows) if not w]

        def block_bytes(num_layers: int) -> int:  # one block of num_layers on one device
            return kv_bytes_per_block(num_layers, block_size, pool_kv_heads // tp, pool_dim,
                                      kv_dtype)

        # one block over the full group's layers: on each device (its KV heads), and in all
        # (a swap); a draft's own pool's block beside it
        draft_block = 0
        if own:
            draft_layers = self._draft.model.config.num_layers
            draft_dim = pool_head_dim(self.backend, self._draft.model.config.head_dim)
            self._draft_dims = (block_size, self._draft.kv_heads, draft_dim, kv_dtype)
            draft_block = kv_bytes_per_block(draft_layers, block_size,
                                             self._draft.kv_heads // tp, draft_dim, kv_dtype)
        per_device = block_bytes(len(self.full_layers)) + draft_block
        self.block_bytes = per_device * tp
        self.window_block_bytes = block_bytes(len(self.window_layers)) * tp  # (a swap)
        try:
            self.num_blocks, self.num_window_blocks = kv_sizing.pool_blocks(
                config, per_device, block_bytes(len(self.window_layers)), self.window,
                max_model_len, devices[0])
        except ValueError as exc:
            if not draft_block:
                raise
            raise ValueError(f"speculative_config.model {config.speculative_config.model!r}: "
                             f"its K/V ({draft_block} bytes a block beside the target's "
                             f"{per_device - draft_block}) does not fit the KV budget: "
                             f"{exc}") from exc
        # K/V bytes a token costs in each kind of layer (a sliding layer's only while the
        # token is in the window), over all devices
        self.kv_bytes_per_token = {
            kind: block_bytes(len(layers)) * tp // block_size
            for kind, layers in (("full_attention", self.full_layers),
                                 ("sliding_attention", self.window_layers)) if layers}
        if own:
            self.kv_bytes_per_token["draft_model"] = draft_block * tp // block_size
        self._pool_dims = (block_size, pool_kv_heads, pool_dim, kv_dtype)
        self._pool_fill = float("nan") if config.debug_nan_pool else 0.0
        self.kv_pool = self._new_pool()
        self.draft_pool = self._new_draft_pool() if own else None
        self.max_model_len = max_model_len
        if config.swap_space and quantized.is_format(kv_dtype):
            raise ValueError(f"swap_space > 0 (a host pool) is not supported with "
                             f"kv_cache_dtype={config.kv_cache_dtype!r}; use swap_space=0")
        # the host pools, one a group (the window group's numbered after the full group's in
        # the swap plans: jaxpage.engine.kv_groups)
        self.num_host_blocks = num_host_blocks = kv_sizing.num_host_blocks(
            config, self.block_bytes, self.window_block_bytes, self.num_blocks,
            self.num_window_blocks)
        self.num_window_host_blocks = window_host_blocks(
            num_host_blocks, self.num_blocks, self.num_window_blocks) if self.window else 0
        self.host_kv = np.zeros((num_host_blocks, len(self.full_layers), 2, pool_kv_heads,
                                 block_size, pool_dim), kv_dtype)
        self.window_host_kv = np.zeros((self.num_window_host_blocks, len(self.window_layers),
                                        2, pool_kv_heads, block_size, pool_dim), kv_dtype)
        self.draft_host_kv = None
        if own:
            bs, heads, dim, _ = self._draft_dims
            self.draft_host_kv = np.zeros((num_host_blocks, draft_layers, 2, heads, bs, dim),
                                          kv_dtype)
        if config.debug_nan_pool and num_host_blocks:  # a read of a host block nobody
            for host in self._host_pools():             # wrote shows too
                host.fill(np.nan)
        max_blocks = -(-max_model_len // block_size)
        # Smallest buckets are set where padding is nearly free, to keep compilations few. On
        # CPU, decode steps are the exception: they start at one row (1, 2, 4, 8, then 1.5x
        # apart, vLLM's CUDA-graph sizes). Such a step reads every weight once whatever its
        # rows, but XLA:CPU splits its elementwise ops over threads from 8 rows on and the
        # sampler reads every padded row's logits: SmolLM2 bfloat16, one sequence, 14.3 ms
        # a step in its own bucket against 17.4 padded to 8 (2 rows 14.6 vs 17.1, 4 rows
        # 15.6 vs 17.2), and a lone request (the CLI, a chat) decodes at one row. On an
        # accelerator 8 rows cost what one does, and each bucket is a slower compilation.
        # Above 8 rows a decode step costs about linearly in its rows on CPU, so its
        # buckets are 1.5x apart rather than 2x (padding 33 sequences to 48 rows, not 64).
        self.token_buckets = power_of_two_buckets(min(16, max_num_batched_tokens),
                                                  max_num_batched_tokens)
        smallest_decode = 1 if devices[0].platform == "cpu" else min(8, max_num_seqs)
        spec = config.speculative_config
        if spec is not None and self.backend == "cpp":
            # a speculative step of a few sequences is a few tokens, which the CPU's kernels
            # run faster in a bucket of their own (SmolLM2 bfloat16 at 200 tokens of context,
            # one sequence's 3 and 5 tokens: 15.0 and 16.5 ms in buckets of 4 and 8, 18.0 and
            # 18.4 ms padded to 16; its decode step 13.1 ms)
            self.token_buckets = [b for b in (2, 4, 8) if b < self.token_buckets[0]] + (
                self.token_buckets)
        self.decode_buckets = power_of_two_buckets(smallest_decode, max_num_seqs,
                                                   midpoints=True)
        # a step's draws: one a sequence (n as a prompt's samples fork), or with speculative
        # decoding one at its last token and at each of its drafts; and with prompt
        # log-probabilities up to one a token
        self.row_buckets = self.decode_buckets + [
            b for b in power_of_two_buckets(smallest_decode, max_num_batched_tokens
                                            + max_num_seqs, midpoints=True)
            if b > max_num_seqs]
        if spec is not None:
            most_rows = min(max_num_batched_tokens, max_num_seqs * (spec.num_speculative_tokens
                                                                    + 1))
            self.row_buckets = sorted(set(self.row_buckets) | {
                b for b in power_of_two_buckets(smallest_decode, most_rows, midpoints=True)
                if b > max_num_seqs})
        self.prefill_seq_buckets = power_of_two_buckets(min(4, max_num_seqs), max_num_seqs)
        # A step's block tables are padded to a width bucket. The CPU's kernels walk each
        # sequence's own blocks (the width is only a table row's stride), so there the one
        # width of max_model_len costs nothing at run time (a few KB more of table a step) and
        # a batch shape compiles once where the buckets compiled it 6-9 times (SmolLM2's
        # server warm-up: 146 step shapes, 45 s of a first start); the Pallas kernels and the
        # jnp paths keep the buckets (their grids and gathers span the width).
        self.width_buckets = [max_blocks] if self.backend == "cpp" else power_of_two_buckets(
            min(max(1, 64 // block_size), max_blocks), max_blocks)
        self.len_buckets = power_of_two_buckets(min(128, max_model_len), max_model_len)
        self.ban_buckets = power_of_two_buckets(8, max(8, model_config.vocab_size))
        most_blocks = max(self.num_blocks, self.num_window_blocks)
        self.copy_buckets = power_of_two_buckets(min(8, most_blocks), most_blocks)
        # a step's swap-outs write distinct host blocks; its swap-ins distinct device blocks
        self.swap_out_buckets = power_of_two_buckets(min(8, max(1, num_host_blocks)),
                                                     max(1, num_host_blocks))
        most_window = max(1, self.num_window_host_blocks)
        self.window_swap_out_buckets = power_of_two_buckets(min(8, most_window), most_window)
        self.compiled: set[tuple] = set()
        self.compile_seconds = 0.0
        self.device_seconds = 0.0  # wall time inside jitted calls (dispatch to result)
        self._init_swaps()
        # A decode step of at most lookahead_rows sequences starts the next one before its
        # own draws are read (`_run_ahead`), the next tokens fed from the device: the host's
        # work of a step (reading the draws, the engine's update, the next step's arrays and
        # dispatch, ~1 ms on CPU) overlaps the device's. 0: never. Not with several
        # processes (their steps are replayed in step).
        rows = config.decode_lookahead_rows
        if rows is None:  # every decode step, on every platform: on a 2-core CPU too, where
            # the host shares the cores with the step, running 16-64 rows ahead took 0.90-1.00x
            # the time of stepping one at a time (SmolLM2, bfloat16; up to 8 rows 0.90-0.91x)
            rows = config.max_num_seqs
        # Nor with a draft model's own pool: its K/V of every step's tokens is computed
        # beside the step (`_keep_draft_in_step`), which a step run ahead would lack.
        self.lookahead_rows = rows if jax.process_count() == 1 and not own else 0
        self.lookahead_hits = self.lookahead_misses = 0  # steps found run ahead, or not
        # of the hits: steps whose rows the run-ahead step lacked ran in a call of their own
        # beside it; rows run ahead that the next step did not take (their sequence ended)
        self.lookahead_split = self.lookahead_dropped = 0
        self._ahead: Ahead | None = None
        # a step's least (sequences, tokens, table width, draw rows): warm-up's bucket shape,
        # few of whose rows hold a token (else 0: the batch's own buckets)
        self._least_shape = (0, 0, 0, 0)
        self.timer = StepTimer(RUNNER_PHASES)  # execute's phases (runner_api)
        # compiled steps kept on disk beside JAX's persistent cache, so a restart loads them
        # without tracing (jaxpage.engine.executables); one process on one device only
        self.executable_store = _executable_store(self.model, devices)
        self._executables: dict[tuple, Any] = {}  # the store's executables by shape key
        # the forward's shape keys start "forward", or the draft's name (`draft_model.Draft.name`)
        self._forward_name = "forward"
        # multi-LoRA: per layer, each projection's stack of max_loras + 1 adapter slots
        # (slot 0 zeros: no adapter; jaxpage.lora), written by `load_lora`
        self.lora_stacks = None
        if config.enable_lora:
            _check_lora(model, self._draft)
            # what a slot's arrays are laid out from: the (global) model config, the rank
            # and dtype (`_lora_slot_arrays`), and the slots' count
            self._lora_layout = (model_config, config.max_lora_rank, dtype, config.max_loras)
            self._lora_shardings = None
            if self.parallel is not None:
                specs = TensorParallel.param_specs(
                    {"layers": self._lora_slot_arrays(None)})["layers"]
                self._lora_shardings = jax.tree.map(
                    lambda spec: NamedSharding(self.parallel.mesh, spec), specs)
            self._set_lora_slot = jax.jit(_set_slot_fn, donate_argnums=0,
                                          out_shardings=self._lora_shardings)
            self.lora_stacks = self._new_lora_stacks()

    @property
    def compiles(self) -> int:
        return len(self.compiled)

    @property
    def max_compiles(self) -> int:
        """Upper bound on compilations over any trace: every bucket combination."""
        widths = len(self.width_buckets)
        rows = len(self.row_buckets)  # logits rows
        query_lens = len(self.token_buckets)  # prefill max_query_len <= its token bucket
        forward = (len(self.decode_buckets) + len(self.token_buckets) * query_lens
                   * len(self.prefill_seq_buckets)) * widths * rows
        # greedy x filters x logprobs x (no penalties + widths) x (no bans + widths) x
        # (grammar masks or not) x (allowed token ids or not) x (no logit bias + widths) x
        # (forced tokens or not)
        sampling = (rows * 2 * 2 * 2 * (1 + len(self.len_buckets)) * (1 + len(self.ban_buckets))
                    * 2 * 2 * (1 + len(self.ban_buckets)) * 2)
        swaps = len(self.swap_out_buckets) + len(self.copy_buckets) if self.num_host_blocks else 0
        window_swaps = (len(self.window_swap_out_buckets) + len(self.copy_buckets)
                        if self.num_window_host_blocks else 0)
        groups = sum(1 for layers in (self.full_layers, self.window_layers) if layers)
        # a run-ahead step's token ids, per decode bucket, and picked out of one or two
        # steps' draws (out, first, second bucket); its inputs made on the device, per
        # decode bucket and width; its penalties' last tokens, per rows, history width and
        # decode bucket
        ahead = (rows + rows ** 2 + rows ** 3 + len(self.decode_buckets) * widths
                 + rows * len(self.len_buckets) * len(self.decode_buckets))
        if self._draft is not None:  # its steps: the target's shapes, its own executables
            forward *= 2
        if self.lora_stacks is not None:  # steps with adapters, and the slot writes
            forward = 2 * forward + 1
        if self.draft_pool is not None:  # and its own pool's copies, fills and swaps
            groups += 1
            swaps *= 2
        return (forward + sampling + 2 * len(self.copy_buckets) * groups  # copies, fills
                + swaps + window_swaps + ahead)

    def copy_blocks(self, copies: list[tuple[int, int]], window: bool = False) -> None:
        """Copy `(src, dst)` blocks in every layer of the full group, or of the window
        group."""
        if not copies:
            return
        size = bucket_for(len(copies), self.copy_buckets)
        src = np.zeros(size, np.int32)
        dst = np.zeros(size, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self._update_group(window, ("copy", size, window), _COPY_BLOCKS, src, dst)
        if self.draft_pool is not None and not window:
            self.draft_pool = self._call(("draft_copy", size), _COPY_BLOCKS,
                                         (self.draft_pool, src, dst))

    def fill_blocks(self, block_ids: list[int], value: float, window: bool = False) -> None:
        """Set every slot of `block_ids` (in every layer of the full group, or of the window
        group, K and V) to `value`."""
        if not block_ids:
            return
        size = bucket_for(len(block_ids), self.copy_buckets)
        ids = np.full(size, block_ids[0], np.int32)
        ids[: len(block_ids)] = block_ids
        self._update_group(window, ("fill", size, window), _FILL_BLOCKS, ids,
                           np.float32(value))
        if self.draft_pool is not None and not window:
            self.draft_pool = self._call(("draft_fill", size), _FILL_BLOCKS,
                                         (self.draft_pool, ids, np.float32(value)))

    def _update_group(self, window: bool, key: tuple, jitted, *args) -> None:
        """Replace one group's layers of the pool by `jitted(layers, *args)` (donating)."""
        layers = self.window_layers if window else self.full_layers
        if not layers:
            return
        pool = self._call(key, jitted, ([self.kv_pool[i] for i in layers], *args))
        kv_pool = list(self.kv_pool)
        for i, layer_kv in zip(layers, pool, strict=True):
            kv_pool[i] = layer_kv
        self.kv_pool = kv_pool

    def pool_lost(self) -> bool:
        """Whether the KV pool's buffers (or the draft's, or the LoRA slots') were freed (a
        donated call failed mid-way)."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves([
            self.kv_pool, self.draft_pool, self.lora_stacks]))

    def reset_pool(self) -> None:
        """A new KV pool (and the draft's), as at start (its old contents are gone); the LoRA
        slots too if they were lost (the engine forgets what every slot held either way)."""
        self.kv_pool = self._new_pool()
        if self.draft_pool is not None:
            self.draft_pool = self._new_draft_pool()
        if self.lora_stacks is not None and any(
                leaf.is_deleted() for leaf in jax.tree.leaves(self.lora_stacks)):
            self.lora_stacks = self._new_lora_stacks()
        self._ahead = None  # it ran on the old pool

    def _new_pool(self):
        """Each layer's (k, v) pool: the full group's layers with num_blocks blocks, the
        window group's with num_window_blocks."""
        pool = [None] * (len(self.full_layers) + len(self.window_layers))
        for layers, num_blocks in ((self.full_layers, self.num_blocks),
                                   (self.window_layers, self.num_window_blocks)):
            if layers:
                group = init_kv_pool(len(layers), num_blocks, *self._pool_dims,
                                     fill_value=self._pool_fill, sharding=self._pool_sharding)
                for i, layer_kv in zip(layers, group, strict=True):
                    pool[i] = layer_kv
        return self._advised(pool)

    def _new_lora_stacks(self) -> list[dict]:
        """Every layer's LoRA slot stacks, zeros, placed as the params are."""
        num_slots = self._lora_layout[3] + 1
        stacks = [{name: np.zeros((num_slots, *a.shape), a.dtype) for name, a in layer.items()}
                  for layer in self._lora_slot_arrays(None)]
        return jax.device_put(stacks, self._lora_shardings or self.devices[0])

    def _lora_slot_arrays(self, weights: Any) -> list[dict]:
        """An adapter's (None: no adapter's) arrays of one slot, per layer, in this runner's
        layout."""
        model_config, max_rank, dtype, _ = self._lora_layout
        arrays = lora_layout.slot_arrays(weights, model_config, max_rank, dtype)
        return arrays if self.parallel is None else self.parallel.lora_layout(arrays)

    def load_lora(self, slot: int, weights: Any) -> None:
        """Write an adapter (jaxpage.lora.LoRAWeights) into slot `slot` of every stack: one
        compiled call for any adapter and slot."""
        values = self._lora_slot_arrays(weights)
        self.lora_stacks = self._call(("load_lora",), self._set_lora_slot,
                                      (self.lora_stacks, np.int32(slot), values))

    def _new_draft_pool(self):
        """The draft model's own pool: its layers' (k, v), num_blocks blocks each."""
        return self._advised(init_kv_pool(self._draft.model.config.num_layers, self.num_blocks,
                                          *self._draft_dims, fill_value=self._pool_fill,
                                          sharding=self._pool_sharding))

    def _advised(self, pool):
        """`pool`, its zeroed pages marked as such on a CPU (`huge_pages.advise_zeroed`)."""
        if self._pool_fill == 0.0 and self.devices[0].platform == "cpu":
            # the K/V arrays and a quantized pool's values hold zeros (its scales hold 1)
            huge_pages.advise_zeroed(
                leaf.values if quantized.is_quantized(leaf) else leaf
                for leaf in jax.tree.leaves(pool, is_leaf=quantized.is_quantized))
        return pool

    def execute(self, seqs: list[SeqInput]) -> list[list[SeqResult]]:
        """Run one step over `seqs`; returns per sequence one drawn token per sampling row
        (none for a non-final prompt chunk, several for a prompt whose samples fork)."""
        self.timer.start()
        if self._draft is not None:
            filled = self._fill_drafts(seqs)
            if self.draft_pool is not None:
                self._keep_draft_in_step(seqs, filled)
        results: list[list[SeqResult]] = [[] for _ in seqs]
        groups = self._groups(seqs)
        if not any(is_decode for _, is_decode in groups) and self._ahead is not None:
            self.lookahead_misses += 1  # run ahead, not taken: run anew
            self._ahead = None
        for group, is_decode in groups:
            for i, result in zip(group, self._run([seqs[i] for i in group], is_decode,
                                                  whole=len(groups) == 1), strict=True):
                results[i] = result
        self.timer.mark("readback")
        return results

    def _groups(self, seqs: list[SeqInput]) -> list[tuple[list[int], bool]]:
        """The calls a step's `seqs` run as: (their indices, is_decode), prefill chunks
        first. A ragged backend runs them as one call, which reads the weights once."""
        decode = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        prefill = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
        if self.ragged and prefill and decode:
            prefill, decode = prefill + decode, []
        return [(group, is_decode) for group, is_decode in ((prefill, False), (decode, True))
                if group]

    @contextlib.contextmanager
    def _drafting(self):
        """The runner as the draft model's for the steps inside: its model, params, pool
        (the target's first layers, or its own) and shape keys (the store keeps
        executables by them). Restored after, the pool as the steps left it (or, failed,
        what is left of it). A draft's own pool pages every layer as full attention: its
        sliding-window layers, given no window tables, read their window from it."""
        draft, target = self._draft, (self.model, self.params, self.kv_pool, self.window)
        self.model, self.params, self._forward_name = draft.model, draft.params, draft.name
        self.kv_pool = self.draft_pool if draft.layers is None else target[2][:draft.layers]
        if draft.layers is None:
            self.window = None
        try:
            yield
        finally:
            if draft.layers is None:
                self.draft_pool, self.kv_pool = self.kv_pool, target[2]
            else:
                self.kv_pool = list(self.kv_pool) + list(target[2][draft.layers:])
            self.model, self.params, self.window = target[0], target[1], target[3]
            self._forward_name = "forward"

    def _fill_drafts(self, seqs: list[SeqInput]) -> list[SeqInput]:
        """Propose the drafts of the speculative steps among `seqs` whose draft slots are
        empty (`speculative.DRAFT_SLOT`): the draft model decodes them greedily, a step per
        draft position over every such sequence, each step's tokens read back for the next
        one, and writes them into the seqs' token ids (the scheduler reads them there).
        Returns those seqs. Each draft step writes the draft's K/V of its token at the
        token's slot: in the draft's own pool, or (the target's first layers) in the
        target's, where the step that verifies the drafts rewrites them with the same
        values."""
        todo = [s for s in seqs if s.verify and s.token_ids[1] == DRAFT_SLOT]
        greedy = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)
        for j in range(max((len(s.token_ids) - 1 for s in todo), default=0)):
            going = [s for s in todo if j < len(s.token_ids) - 1]
            with self._drafting():
                step = self._dispatch([SeqInput(s.block_table, s.num_computed + j,
                                                [s.token_ids[j]], [greedy],
                                                s.window_block_table) for s in going], True)
            for s, drawn in zip(going, self._results(step), strict=True):
                s.token_ids[j + 1] = drawn[0].token
        return todo

    def _keep_draft_in_step(self, seqs: list[SeqInput], filled: list[SeqInput]) -> None:
        """Start the draft model's forward over the tokens of this step (nothing drawn), so
        that its own pool holds its K/V of every token the target's holds. A sequence whose
        drafts it proposed already wrote all but its last draft's (`_fill_drafts`)."""
        proposed = {id(s) for s in filled}
        inputs = [SeqInput(s.block_table, s.num_computed + len(s.token_ids) - 1,
                           s.token_ids[-1:], [], s.window_block_table) if id(s) in proposed
                  else SeqInput(s.block_table, s.num_computed, s.token_ids, [],
                                s.window_block_table) for s in seqs]
        with self._drafting():
            for group, is_decode in self._groups(inputs):
                self._dispatch([inputs[i] for i in group], is_decode)

    def warmup(self, shapes: int | None = None) -> tuple[int, float]:
        """Compile the shapes a server meets first, before it serves: a decode step at every
        decode-batch bucket and block-table width bucket, and a one-prompt chunk at every
        token bucket and width bucket, greedy, the sampler's sampled variant at every decode
        bucket, and the run-ahead steps' token ids (the first `shapes` of these only, if
        given: the server's restart runs one, its steps loaded ahead, to pay what a process's
        first step costs before it serves). Steps mixing several prompts, or prompts and
        decodes, compile on first use (and come from JAX's persistent cache when it is on).
        The steps write only into the reserved block 0, and each is one short sequence
        padded to its bucket's shape (`_least_shape`): the padding rows cost the CPU's
        packed matmuls nothing, so a step costs its compilation, not its run (run full, at
        full context, running them took 137 of 277 s for SmolLM2; with the compiled steps
        loaded from disk, running them was 12.9 of a restart's 23.1 s of warm-up). Returns
        (new compilations, seconds)."""
        before, start = self.compiles, time.perf_counter()
        greedy = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)
        sampled = SamplingRow(SamplingParams(), seed=0, step=0)

        def step(shape: tuple[int, int, int, int], width: int, num_tokens: int,
                 row: SamplingRow) -> None:
            """A step of `shape` (`_least_shape`) whose one sequence has `num_tokens`."""
            self._least_shape = shape
            try:
                self.execute([SeqInput([0] * width, 0, [0] * num_tokens, [row], [0] * width)])
            finally:
                self._least_shape = (0, 0, 0, 0)

        def next_tokens(num_seqs: int) -> None:  # a run-ahead step's token ids
            self._call(("next_tokens", num_seqs), NEXT_TOKENS, (
                jax.device_put(np.zeros(num_seqs, np.int32), self._input_sharding), num_seqs))

        plan = []
        for num_seqs in self.decode_buckets:
            for width in self.width_buckets:
                plan.append(functools.partial(step, (num_seqs, 0, width, num_seqs), width, 1,
                                              greedy))
            plan.append(functools.partial(step, (num_seqs, 0, 0, num_seqs),
                                          self.width_buckets[0], 1, sampled))
        for num_tokens in self.token_buckets:  # a prompt chunk (its one draw: a decode row's)
            tokens = min(num_tokens, self.max_model_len)
            for width in self.width_buckets:
                if min(width * self.block_size, self.max_model_len) >= tokens:
                    # a ragged step's shape is its token bucket: two of its tokens suffice
                    plan.append(functools.partial(step, (0, tokens, width, 0), width,
                                                  2 if self.ragged else tokens, greedy))

        def advance(num_seqs: int, width: int) -> None:  # a run-ahead step's inputs
            num_rows = bucket_for(num_seqs, self.row_buckets)
            positions, attn_md = build_metadata(
                [[0] * width], [0], [1], self.block_size, max_blocks_per_seq=width,
                num_tokens=num_seqs, num_seqs=num_seqs, max_query_len=1, num_logits=num_rows,
                backend=self.backend, interpret=self.interpret,
                window_block_tables=None if self.window is None else [[0] * width])
            self._call(("advance", num_seqs, num_rows, self.window is not None, width),
                       ADVANCE, (1, *jax.device_put((positions, attn_md, np.zeros(
                           num_rows, np.int32)), self._input_sharding)),
                       static=(self.block_size,))

        ahead_buckets = sorted({bucket_for(n, self.decode_buckets) for n in range(
            1, min(self.lookahead_rows, self.decode_buckets[-1]) + 1)})
        plan += [functools.partial(next_tokens, num_seqs) for num_seqs in ahead_buckets]
        plan += [functools.partial(advance, num_seqs, width) for num_seqs in ahead_buckets
                 for width in self.width_buckets]
        for run in plan[:shapes]:
            run()
        return self.compiles - before, time.perf_counter() - start

    def _run(self, seqs: list[SeqInput], is_decode: bool, whole: bool = True
             ) -> list[list[SeqResult]]:
        """One call of the step function over `seqs`, the next decode step started where it
        may run ahead, then this step's draws read back. A decode step uses the step run
        ahead last time for every row that is the same computation there (`ahead_rows`):
        rows of sequences that since ended or were preempted are dropped, and the rows it
        lacks (a request that arrived, a row that changed) run in a call of their own, when
        they are no more than the rows it serves (else the whole step runs anew). A step
        with prompt chunks runs ahead too, when it is the `whole` step (one call) and each of
        its prompts ends in it (`SeqInput.may_run_ahead`)."""
        if not is_decode:
            served = Served([self._dispatch(seqs, False)], [(0, i) for i in range(len(seqs))])
            return self._read(seqs, served, whole)
        ahead, self._ahead = self._ahead, None
        rows = [None] * len(seqs)
        if ahead is not None:
            rows = ahead_rows(ahead.seqs, seqs, self.block_size, self.window)
            if 2 * rows.count(None) > len(seqs):
                rows = [None] * len(seqs)
        missing = [i for i, row in enumerate(rows) if row is None]
        if ahead is not None:
            taken = len(seqs) - len(missing)
            self.lookahead_misses += taken == 0
            self.lookahead_hits += taken > 0
            self.lookahead_split += 0 < taken < len(seqs)
            self.lookahead_dropped += (ahead.step.num_seqs - taken) if taken else 0
        if len(missing) == len(seqs):
            served = Served([self._dispatch(seqs, True)], [(0, i) for i in range(len(seqs))])
        else:
            served = Served([ahead.step], [(0, row) for row in rows])
            self.timer.mark("prepare")
            if missing:
                served.steps.append(self._dispatch([seqs[i] for i in missing], True))
                for k, i in enumerate(missing):
                    served.rows[i] = (1, k)
        return self._read(seqs, served)

    def _read(self, seqs: list[SeqInput], served: Served, run_ahead: bool = True
              ) -> list[list[SeqResult]]:
        """The draws of the dispatched step `served` for each of `seqs`, read back after the
        step after it was started where it may run ahead (`_run_ahead`; with `run_ahead`
        False the one run ahead before is left as it is)."""
        try:
            if run_ahead:
                self._ahead = self._run_ahead(seqs, served)
            drawn = [self._results(step) for step in served.steps]
        except BaseException:
            self._ahead = None  # it would run on this step's pool and tokens
            raise
        results = [drawn[which][row] for which, row in served.rows]
        if run_ahead and self._ahead is not None:  # its inputs, now that the tokens are known
            for seq, i in zip(self._ahead.seqs, self._ahead.sources, strict=True):
                seq.token_ids = [token] = [results[i][0].token]
                fill_history(seq.sampling[0], token)
            self.timer.mark("readback")
        return results

    def _dispatch(self, seqs: list[SeqInput], is_decode: bool,
                  token_ids: jax.Array | None = None) -> Step:
        """Build a step's arrays and start its forward and sampler on the device (`token_ids`:
        the new tokens already on the device, in place of the seqs' own)."""
        least_seqs, least_tokens, least_width, least_rows = self._least_shape
        num_seqs = max(least_seqs, bucket_for(
            len(seqs), self.decode_buckets if is_decode else self.prefill_seq_buckets))
        total = sum(len(s.token_ids) for s in seqs)
        num_tokens = num_seqs if is_decode else max(least_tokens,
                                                    bucket_for(total, self.token_buckets))
        width = max(least_width, bucket_for(
            max(-(-(s.num_computed + len(s.token_ids)) // self.block_size) for s in seqs),
            self.width_buckets))
        # The jnp paths pad every sequence's queries to max_query_len, so it is bucketed from
        # the longest chunk, not from the whole token count. A ragged backend walks each
        # sequence's own queries: one value per token bucket compiles fewer shapes.
        max_query_len = 1 if is_decode else num_tokens if self.ragged else min(
            bucket_for(max(len(s.token_ids) for s in seqs), self.token_buckets), num_tokens)
        # one logits row per draw: a sequence's last token, repeated for forking samples,
        # or each of a speculative step's tokens
        logits_indices, end = [], 0
        for s in seqs:
            start, end = end, end + len(s.token_ids)
            if s.verify:
                logits_indices += range(start, end)
                continue
            if s.num_scores:  # prompt log-probabilities: the logits at each scored token
                logits_indices += range(start + s.score_from,
                                        start + s.score_from + s.num_scores)
            logits_indices += [end - 1] * (len(s.sampling) - s.num_scores)
        rows = [(i, row) for i, s in enumerate(seqs) for row in s.sampling]
        num_rows = max(least_rows, bucket_for(max(len(rows), 1), self.row_buckets))
        tables = [[s.block_table[:width] for s in seqs]]
        if self.window is not None:
            tables.append([s.window_block_table[:width] for s in seqs])
        positions, attn_md = build_metadata(
            tables[0],
            [s.num_computed for s in seqs],
            [len(s.token_ids) for s in seqs],
            self.block_size,
            max_blocks_per_seq=width,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            logits_indices=logits_indices,
            num_logits=num_rows,
            backend=self.backend,
            interpret=self.interpret,
            window_block_tables=tables[1] if self.window is not None else None,
        )
        run_ahead = token_ids is not None
        if not run_ahead:
            token_ids = np.zeros(num_tokens, np.int32)
            token_ids[:total] = [t for s in seqs for t in s.token_ids]
            if self.lookahead_rows:  # on the device, as a run-ahead step's: one compilation
                token_ids = jax.device_put(token_ids, self._input_sharding)
        # A pure decode step's inputs stay on the device, where the step after it is made
        # from them (`_advance`): one token and one draw a sequence. Every decode step's and
        # every sampler's go there (a shape's one compilation, and its one kept executable
        # whichever step meets it first).
        keep = is_decode and self.lookahead_rows and len(rows) == len(seqs)
        if is_decode and self.lookahead_rows:
            packed = [attn_md.block_tables] + ([attn_md.window_block_tables]
                                               if self.window is not None else [])
            positions, attn_md = jax.device_put((positions, attn_md), self._input_sharding)

        key, slots = (self._forward_name, num_tokens, max_query_len, num_seqs, width,
                      num_rows), None
        if self.lora_stacks is not None and any(s.lora_slot for s in seqs):
            # each token's adapter slot (padding: 0); a step without adapters runs as if
            # LoRA were off (its own executables, the CPU's fused layers)
            slots = np.zeros(num_tokens, np.int32)
            slots[:total] = np.repeat([s.lora_slot for s in seqs],
                                      [len(s.token_ids) for s in seqs])
            key += ("lora",)
        timer = self.timer
        timer.mark("prepare")
        logits, self.kv_pool = self._call(
            key, _FORWARD, (self._step_params(slots), self.kv_pool, token_ids, positions,
                            attn_md), timer, static=(self.model, self.devices[0].platform))
        step = Step(len(seqs), rows, num_rows)
        if not rows:  # only non-final prompt chunks: nothing to draw
            return step
        sampling_md = SamplingMetadata.pack([row for _, row in rows], num_rows,
                                            ban_buckets=self.ban_buckets,
                                            history_buckets=self.len_buckets,
                                            vocab_size=logits.shape[-1])
        sampling_key = ("sample", num_rows, sampling_md.use_filters, sampling_md.num_logprobs,
                        sampling_md.all_greedy,
                        *(None if a is None else a.shape[1] for a in (
                            sampling_md.prompt_token_ids, sampling_md.banned_token_ids,
                            sampling_md.grammar_bitmask, sampling_md.allowed_bitmask,
                            sampling_md.bias_token_ids)),
                        sampling_md.forced_token_ids is not None)
        if self.lookahead_rows:
            sampling_md = jax.device_put(sampling_md, self._input_sharding)
            if run_ahead and sampling_md.use_penalties:  # their last tokens, on the device
                sampling_md = self._with_history(
                    sampling_md, history_slots([row for _, row in rows]), token_ids)
        if keep:
            step.inputs = DecodeInputs(key, slots, positions, attn_md, sampling_key,
                                       sampling_md, width, tables, packed)
        timer.mark("prepare")
        step.drawn = self._call(sampling_key, _SAMPLE, (logits, sampling_md), timer)
        return step

    def _advance(self, prev: Step, seqs: list[SeqInput], token_ids: jax.Array,
                 history: list[int] | None) -> Step:
        """`_dispatch(seqs, True, token_ids)` for `seqs`, the sequences of the pure decode
        step `prev` each one position on (its rows, in order), its inputs made on the device
        from `prev`'s (`ADVANCE`): on the host only the block-table rows that changed since
        are packed, and the table copied up again when one did."""
        inputs, width = prev.inputs, prev.inputs.width
        tables, packed, attn_md = [], [], inputs.attn_md
        for group, (rows, array) in enumerate(zip(inputs.tables, inputs.packed, strict=True)):
            # the rows whose table changed (a block taken for the next one, a block copied
            # on write, one left the window) are packed anew and the tables uploaded again
            now = [(s.window_block_table if group else s.block_table)[:width] for s in seqs]
            changed = [k for k, (new, old) in enumerate(zip(now, rows, strict=True)) if new != old]
            if changed:
                array = array.copy()  # the device may hold the old array's memory
                for k in changed:
                    array[k] = 0
                    array[k, :len(now[k])] = now[k]
                field = "window_block_tables" if group else "block_tables"
                attn_md = dataclasses.replace(attn_md, **{
                    field: jax.device_put(array, self._input_sharding)})
            tables.append(now)
            packed.append(array)
        positions, attn_md, steps = self._call(
            ("advance", inputs.key[1], prev.num_rows, len(tables) == 2, width), ADVANCE,
            (len(seqs), inputs.positions, attn_md, inputs.sampling_md.steps),
            static=(self.block_size,))
        sampling_md = self._with_history(dataclasses.replace(inputs.sampling_md, steps=steps),
                                         history, token_ids)
        timer = self.timer
        logits, self.kv_pool = self._call(
            inputs.key, _FORWARD, (self._step_params(inputs.lora_slots), self.kv_pool,
                                   token_ids, positions, attn_md),
            timer, static=(self.model, self.devices[0].platform))
        step = Step(len(seqs), [(i, s.sampling[0]) for i, s in enumerate(seqs)],
                    prev.num_rows, inputs=DecodeInputs(inputs.key, inputs.lora_slots, positions,
                                                       attn_md, inputs.sampling_key,
                                                       sampling_md, width, tables, packed))
        timer.mark("prepare")
        step.drawn = self._call(inputs.sampling_key, _SAMPLE, (logits, sampling_md), timer)
        return step

    def _with_history(self, sampling_md: SamplingMetadata, slots: list[int] | None,
                      token_ids: jax.Array) -> SamplingMetadata:
        """A run-ahead step's sampler metadata with each penalized row's last output token
        (the step before drew it: `token_ids`, row r sequence r) written on the device at
        its row's placeholder (`slots`: `history_slots` of the rows; None: no penalties)."""
        if slots is None:
            return sampling_md
        history = sampling_md.output_token_ids
        width = history.shape[1]  # past it: no token to write
        at = np.full(history.shape[0], width, np.int32)
        at[:len(slots)] = [width if s < 0 else s for s in slots]
        history = self._call(("append_history", *history.shape, token_ids.shape[0]),
                             APPEND_HISTORY, (history, jax.device_put(at, self._input_sharding),
                                              token_ids), self.timer)
        return dataclasses.replace(sampling_md, output_token_ids=history)

    def _step_params(self, lora_slots: np.ndarray | None) -> Any:
        """A step's params: the model's, and with `lora_slots` (each token's adapter slot)
        the adapters' stacks as they are now (a slot load replaces them)."""
        if lora_slots is None:
            return self.params
        return dict(self.params, lora={"slots": lora_slots, "layers": self.lora_stacks})

    def _results(self, step: Step) -> list[list[SeqResult]]:
        """A dispatched step's draws, read back from the device (waiting for it)."""
        results: list[list[SeqResult]] = [[] for _ in range(step.num_seqs)]
        if not step.rows:
            return results
        start = time.perf_counter()
        step.drawn["tokens"].block_until_ready()  # every output of the sampler's one call
        self.timer.mark("wait")
        out = jax.device_get(step.drawn)
        self.device_seconds += time.perf_counter() - start
        tokens, logprobs = out["tokens"].tolist(), out["logprob"].tolist()  # Python numbers
        for r, (i, row) in enumerate(step.rows):
            top = None
            if row.num_logprobs:
                n = row.num_logprobs
                top = dict(zip(out["top_ids"][r, :n].tolist(),
                               out["top_logprobs"][r, :n].tolist(), strict=True))
            results[i].append(SeqResult(tokens[r], logprobs[r], top))
        self.timer.mark("readback")
        return results

    def _run_ahead(self, seqs: list[SeqInput], served: Served) -> Ahead | None:
        """Start the decode step after `seqs` (None where it may not run ahead): each sequence
        that goes on one position further, its new token the one `served` draws for it,
        taken on the device (the host reads it meanwhile). Only a step of at most
        lookahead_rows sequences of one draw each, each of which the scheduler marked as
        going on (`SeqInput.may_run_ahead`: a decode, or a prompt's last chunk, its next slot
        in a block it holds) or as ending with this draw (`SeqInput.ends`: it is left out),
        one going on."""
        if not 0 < len(seqs) <= self.lookahead_rows:
            return None
        going = []
        for i, s in enumerate(seqs):
            if len(s.sampling) != 1:  # (then a sequence's index is its row's)
                return None
            block = (s.num_computed + len(s.token_ids)) // self.block_size  # the next token's
            if s.may_run_ahead and block < len(s.block_table) and (
                    s.window_block_table is None or block < len(s.window_block_table)):
                going.append(i)
            elif not s.ends:
                return None
        if not going:
            return None
        nxt = [SeqInput(s.block_table, s.num_computed + len(s.token_ids), [0],
                        [next_row(s.sampling[0])], s.window_block_table, True,
                        lora_slot=s.lora_slot)
               for s in (seqs[i] for i in going)]
        self.timer.mark("prepare")
        steps, picks = served.steps, [served.rows[i] for i in going]
        if len(steps) == 1 and steps[0].num_seqs == len(picks) and all(
                row == k for k, (_, row) in enumerate(picks)):  # one step, all of it
            tokens = self._call(("next_tokens", steps[0].num_rows), NEXT_TOKENS,
                                (steps[0].drawn["tokens"], len(picks)), self.timer)
            inputs = steps[0].inputs
            # penalized rows' placeholders (none where the step before had no penalties)
            history = None if inputs is None or not inputs.sampling_md.use_penalties else (
                history_slots([s.sampling[0] for s in nxt]))
            if inputs is not None and inputs.width == bucket_for(max(
                    -(-(s.num_computed + 1) // self.block_size) for s in nxt),
                    self.width_buckets) and (history is None or max(history) < (
                        inputs.sampling_md.output_token_ids.shape[1])):
                # its tables hold the next step's blocks, its sampler's history the tokens
                return Ahead(nxt, self._advance(steps[0], nxt, tokens, history), going)
        else:  # rows left out, or drawn by two steps: picked out of both on the device
            offsets = [0, steps[0].num_rows]
            picked = np.zeros(bucket_for(len(picks), self.decode_buckets), np.int32)
            picked[:len(picks)] = [offsets[which] + row for which, row in picks]
            picked = jax.device_put(picked, self._input_sharding)
            drawn = [step.drawn["tokens"] for step in steps]
            tokens = self._call(("pick_tokens", picked.shape[0], *(d.shape[0] for d in drawn)),
                                PICK_TOKENS, (picked, len(picks), *drawn), self.timer)
        return Ahead(nxt, self._dispatch(nxt, True, token_ids=tokens), going)

    def _call(self, key: tuple, jitted, args: tuple, timer: StepTimer | None = None, *,
              static: tuple = ()):
        """`jitted(*static, *args)`, or its executable from the store where there is one
        (`executables`), for the shape `key`. The first call of a key is a compilation (or a
        load), timed (to completion) as such. Later calls are not synchronized here, so the
        forward's execution overlaps the sampler's dispatch; its time lands in the wait for
        the sampler's draws. With `timer`, the call ends its "dispatch" phase (or
        "compile")."""
        start = time.perf_counter()
        if key in self.compiled:
            executable = self._executables.get(key)
            result = jitted(*static, *args) if executable is None else executable(*args)
            self.device_seconds += time.perf_counter() - start
            if timer is not None:
                timer.mark("dispatch")
            return result
        if self.executable_store is None:
            result = jax.block_until_ready(jitted(*static, *args))
        else:
            executable = self.executable_store.get(key, jitted, static, args)
            self._executables[key] = executable
            result = jax.block_until_ready(executable(*args))
        self.compile_seconds += time.perf_counter() - start
        self.compiled.add(key)
        if timer is not None:
            timer.mark("compile")
        return result



def _check_lora(model: Any, draft: Any) -> None:
    """Refuse enable_lora where adapters cannot run, naming why."""
    served = getattr(model, "local", model)  # a tensor-parallel model: the model it splits
    if not getattr(served, "supports_lora", False):
        raise ValueError(f"enable_lora: {type(served).__name__} takes no LoRA adapters "
                         "(Llama-family and Gemma models do)")
    if jax.process_count() > 1:
        raise ValueError("enable_lora is not supported with several processes (jax.distributed)")
    if draft is not None and draft.layers is not None:
        raise ValueError("enable_lora with a speculative draft of the target's own first "
                         "layers (speculative_config.draft_layers) is not supported")


def _executable_store(model: Any, devices: list) -> executables.ExecutableStore | None:
    """The store of compiled steps where they are kept (`executables.keep_in`, which
    `jaxpage.engine_args.enable_compile_cache` calls), for a runner of one device in one
    process; else None."""
    directory = executables.kept_in()
    if not directory or len(devices) != 1 or jax.process_count() != 1:
        return None
    return executables.ExecutableStore(directory, executables.context_digest(model, devices),
                                       devices[0])

