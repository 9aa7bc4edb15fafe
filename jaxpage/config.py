"""EngineConfig: every engine knob in one frozen dataclass; `configs/*.json` map onto it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxpage import constants
from jaxpage.engine.block_allocator import POLICIES as RESERVATION_POLICIES
from jaxpage.engine.speculative import SpeculativeConfig
from jaxpage.engine.swap_cost import PREEMPTION_MODES
from jaxpage.validation import check, is_int, is_positive_int, is_real

# "auto": the platform's kernel (jaxpage.attention.select_backend)
ATTENTION_BACKENDS = ("auto", *constants.ATTENTION_BACKENDS)
DTYPES = ("float32", "bfloat16")
# the KV pool's storage: "auto" is the model dtype; the 8-bit formats keep a float32 scale per
# KV head and token (pallas_kernels/quantized.py)
KV_CACHE_DTYPES = ("auto", *DTYPES, "float8_e4m3fn", "float8_e5m2", "int8")
# weight-only quantization of the decoder's projections (jaxpage.loading.quantization)
QUANTIZATIONS = ("int8", "fp8")


def choices(field: str) -> tuple | None:
    """The allowed values of an EngineConfig field that takes one of a fixed list (for the
    command-line flags), else None."""
    return {"dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "quantization": QUANTIZATIONS,
            "attention_backend": ATTENTION_BACKENDS,
            "reservation_policy": RESERVATION_POLICIES,
            "preemption_mode": PREEMPTION_MODES}.get(field)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine is sized and what it serves.

    kv_cache_dtype: the KV pool's storage. "auto": the model's dtype; "float32" /
      "bfloat16"; "float8_e4m3fn", "float8_e5m2", "int8": 8-bit values with a float32 scale
      per KV head and token, set when the token is written (pallas_kernels/quantized.py):
      3.76x the tokens of a float32 pool per byte at head_dim 64, 3.88x at 128.

    quantization: the decoder's projections (qkv, o, gate_up, down, MoE experts) in 8 bits
      with a float32 scale per output column, quantized while loading; the activations, the
      embedding, the norms and the LM head stay in `dtype` (weight-only, W8A16). "int8":
      symmetric int8; "fp8": float8_e4m3fn. None: full width, unless the checkpoint is stored
      quantized (compressed-tensors int8 / fp8), which loads as stored
      (jaxpage.loading.quantization).
    quantize_lm_head: with `quantization`, the LM head too, a scale per vocabulary entry (a
      tied head is the embedding: its rows are read back as values * scale). Off by default,
      as in vLLM; on a small model whose head is a large share of its weights (SmolLM2-135M:
      36% of them in int8) it is the share a decode step still reads at full width.

    num_blocks: KV pool size in blocks (block 0 is reserved); if None, sized from
      kv_cache_memory (bytes), else from a default budget (1 GiB on CPU; on an accelerator
      gpu_memory_utilization of the memory left after the weights).
    num_window_blocks: for a model with sliding-window layers, the blocks of their own pool
      (the window group, jaxpage.engine.kv_groups); if None, what max_num_seqs sequences'
      windows hold at most, within those layers' share of the budget.
    max_model_len: longest sequence (prompt + output); default the model's limit.
    reservation_policy: "paged" (blocks on demand). "max" and "oracle" reserve blocks for
      max_model_len or prompt + max_tokens at admission: pre-paging baselines for benchmarks.
    swap_space: bytes of host memory for a host pool of KV blocks (0: none). It holds the
      blocks of swapped-out sequences and, with enable_host_prefix_cache (and prefix
      caching on), the prefix cache's second tier: cached blocks evicted from the device
      pool, copied back on a hit instead of prefilled again.
    preemption_mode: what a preempted request's K/V becomes. "recompute": freed, prefilled
      again on readmission. "swap": copied to the host pool and back (recompute when the
      host pool is full). "auto": swapped when the cost model says that is cheaper
      (jaxpage.engine.swap_cost), from swap_bandwidth (bytes/s) and
      prefill_seconds_per_token, each measured as the engine runs unless given here.
    """

    model: str = constants.DEFAULT_MODEL
    # a Hugging Face Hub id's branch, tag or commit (default: main); local paths ignore it
    revision: str | None = None
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    quantize_lm_head: bool = False
    block_size: int = 16
    num_blocks: int | None = None
    num_window_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    kernel_interpret: bool = False  # Pallas kernels in interpret mode (tests on CPU)
    reservation_policy: str = "paged"
    # devices the model is split over (mesh axis "model"; jaxpage.parallel)
    tensor_parallel_size: int = 1
    # independent replicas, each on its own tensor_parallel_size devices
    # (jaxpage.engine.data_parallel)
    data_parallel_size: int = 1
    seed: int = 0
    # debugging: the KV pool starts as NaN and every block released is refilled with NaN
    # before it is handed out again, so a read of K/V a sequence does not own shows
    debug_nan_pool: bool = False
    swap_space: int = 0
    preemption_mode: str = "recompute"
    enable_host_prefix_cache: bool = True
    swap_bandwidth: float | None = None
    prefill_seconds_per_token: float | None = None
    # a GGUF model is converted once to a jaxpage checkpoint under $JAXPAGE_CACHE_DIR
    # (~/.cache/jaxpage/gguf) and loaded from it later (jaxpage.loading.gguf_cache)
    cache_gguf: bool = True
    # a decode step of at most this many sequences starts the next step before its own draws
    # are read, feeding them to it on the device (vLLM's async scheduling); the next step
    # takes the rows that are still the same computation (ModelRunner._run). 0: never; None:
    # every step (max_num_seqs), on every platform
    decode_lookahead_rows: int | None = None
    # speculative decoding, as vLLM's speculative_config (a dict, or a SpeculativeConfig:
    # jaxpage.engine.speculative), e.g. {"method": "ngram", "num_speculative_tokens": 3};
    # None: off
    speculative_config: SpeculativeConfig | None = None
    # multi-LoRA (jaxpage.lora): requests may name a PEFT adapter (LoRARequest); max_loras
    # adapters mix in one step (device slots, reused least recently used first), each of rank
    # at most max_lora_rank; max_cpu_loras adapters stay read in host memory (default
    # max_loras; those of unfinished requests always stay)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))
        check(self.revision is None or (isinstance(self.revision, str) and self.revision),
              "revision", self.revision, "None or a non-empty branch, tag or commit")
        check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
              f"one of {KV_CACHE_DTYPES}")
        check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
              self.quantization, f"None or one of {QUANTIZATIONS}")
        check(isinstance(self.quantize_lm_head, bool), "quantize_lm_head",
              self.quantize_lm_head, "a bool")
        check(not self.quantize_lm_head or self.quantization is not None, "quantize_lm_head",
              self.quantize_lm_head, 'False unless quantization is set ("int8" or "fp8")')
        check(is_positive_int(self.block_size), "block_size", self.block_size, "an integer >= 1")
        check(self.num_blocks is None
              or (is_positive_int(self.num_blocks) and self.num_blocks >= 2),
              "num_blocks", self.num_blocks, "None or an integer >= 2 (block 0 is reserved)")
        check(self.num_window_blocks is None
              or (is_positive_int(self.num_window_blocks) and self.num_window_blocks >= 2),
              "num_window_blocks", self.num_window_blocks,
              "None or an integer >= 2 (block 0 is reserved)")
        check(self.kv_cache_memory is None or is_positive_int(self.kv_cache_memory),
              "kv_cache_memory", self.kv_cache_memory, "None or a positive number of bytes")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
              self.gpu_memory_utilization, "in (0, 1]")
        check(self.max_model_len is None or is_positive_int(self.max_model_len),
              "max_model_len", self.max_model_len, "None or an integer >= 1")
        check(is_positive_int(self.max_num_seqs), "max_num_seqs", self.max_num_seqs,
              "an integer >= 1")
        check(is_positive_int(self.max_num_batched_tokens), "max_num_batched_tokens",
              self.max_num_batched_tokens, "an integer >= 1")
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
              self.attention_backend, f"one of {ATTENTION_BACKENDS}")
        check(self.reservation_policy in RESERVATION_POLICIES, "reservation_policy",
              self.reservation_policy, f"one of {RESERVATION_POLICIES}")
        check(is_positive_int(self.tensor_parallel_size), "tensor_parallel_size",
              self.tensor_parallel_size, "an integer >= 1")
        check(is_positive_int(self.data_parallel_size), "data_parallel_size",
              self.data_parallel_size, "an integer >= 1")
        check(is_int(self.seed), "seed", self.seed, "an integer")
        check(isinstance(self.debug_nan_pool, bool), "debug_nan_pool", self.debug_nan_pool,
              "True or False")
        check(is_int(self.swap_space) and self.swap_space >= 0, "swap_space", self.swap_space,
              "an integer number of bytes >= 0")
        check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
              self.preemption_mode, f"one of {PREEMPTION_MODES}")
        check(self.preemption_mode == "recompute" or self.swap_space > 0, "preemption_mode",
              self.preemption_mode, "'recompute' when swap_space is 0 (no host pool to swap to)")
        check(isinstance(self.enable_host_prefix_cache, bool), "enable_host_prefix_cache",
              self.enable_host_prefix_cache, "True or False")
        check(isinstance(self.cache_gguf, bool), "cache_gguf", self.cache_gguf,
              "True or False")
        check(self.decode_lookahead_rows is None or (is_int(self.decode_lookahead_rows)
                                                     and self.decode_lookahead_rows >= 0),
              "decode_lookahead_rows", self.decode_lookahead_rows, "an integer >= 0 or None")
        check(isinstance(self.enable_lora, bool), "enable_lora", self.enable_lora,
              "True or False")
        check(is_positive_int(self.max_loras), "max_loras", self.max_loras, "an integer >= 1")
        check(is_positive_int(self.max_lora_rank) and self.max_lora_rank <= 512,
              "max_lora_rank", self.max_lora_rank, "an integer in [1, 512]")
        check(self.max_cpu_loras is None or (is_positive_int(self.max_cpu_loras)
                                             and self.max_cpu_loras >= self.max_loras),
              "max_cpu_loras", self.max_cpu_loras, f"None or an integer >= max_loras "
              f"({self.max_loras})")
        for name in ("swap_bandwidth", "prefill_seconds_per_token"):
            value = getattr(self, name)
            check(value is None or (is_real(value) and 0 < value < float("inf")), name, value,
                  "None (measured) or a positive finite number")

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> EngineConfig:
        """A preset from a JSON file whose keys are EngineConfig fields."""
        with open(path) as f:
            values = json.load(f)
        values.pop("_comment", None)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown EngineConfig fields {sorted(unknown)}")
        return cls(**{**values, **overrides})
