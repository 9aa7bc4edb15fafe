"""Load a llama.cpp GGUF file: config from its metadata, dequantized params, tokenizer.

The GGUF metadata is turned into an HF `config.json`-style dict (so `ModelConfig.from_hf`
does the validation), every tensor is dequantized to float32 with `gguf.quants`, renamed
to its HF name, and handed to `params_from_hf_tensors`, which checks shapes and builds the
jaxpage layout (a MoE layer's experts, stacked in one GGUF tensor per projection, are handed
over one expert at a time under their per-expert HF names). Two llama.cpp conventions are
undone on the way:

* `convert_hf_to_gguf.py` permutes the rows of q_proj / k_proj (weights and biases) of
  the llama architecture, per head, from HF's half-split rotary layout to llama.cpp's
  interleaved-pairs layout; `unpermute_rope_rows` inverts it. qwen2 / qwen3 are stored
  unpermuted (llama.cpp runs them with NEOX-style rope, which is HF's layout).
* Llama 3.1-style rope scaling is not in the metadata but baked into a `rope_freqs.weight`
  tensor of per-frequency divisors; `llama3_rope_from_factors` recovers the HF
  `rope_scaling` dict from it and checks it reproduces every factor.
* Gemma's RMSNorms scale by 1 + weight; convert_hf_to_gguf stores every `*norm.weight`
  of gemma2 / gemma3 with the 1 added, which is subtracted again here.

Gemma files leave out what llama.cpp hard-codes, and `gemma_config_from_gguf` fills it in
the way llama.cpp does: the sliding-window pattern (every 2nd / 6th layer global), Gemma
3's local rope base (10000) and the attention scale (query_pre_attn_scalar: head_dim,
except hidden_size / num_heads for the 27B models, told apart by their layer count).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np

from jaxpage.loading.errors import WeightsError
from jaxpage.loading.hf_families import HF_MOE_NAMES, params_from_hf_tensors
from jaxpage.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

# general.architecture -> HF architecture. Mistral GGUFs say "llama", and so do Mixtral's
# (told apart by their `llama.expert_count`).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Architectures whose q/k rows convert_hf_to_gguf permutes for interleaved rope.
ROPE_PERMUTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF name, without the ".weight" / ".bias" suffix.
TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Inside a block: "blk.N.<gguf>" -> "model.layers.N.<hf>".
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma blocks have four norms: attn_norm, post_attention_norm, ffn_norm (before the
# MLP) and post_ffw_norm.
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ARCH_LAYER_NAMES = {"gemma2": GEMMA_LAYER_NAMES, "gemma3": GEMMA_LAYER_NAMES}
# Architectures whose norm weights convert_hf_to_gguf stores with 1 added.
NORM_SHIFTED_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp's Gemma constants: every `period`-th layer is global; the layer count of
# the 27B model, whose attention scale is (hidden_size / num_heads) ** -0.5.
GEMMA_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# A MoE block's router and its experts, each stacked [E, ...] in one tensor by
# convert_hf_to_gguf: "blk.N.<gguf>.weight" -> the HF names' parts (see hf_families.HF_MOE_NAMES).
EXPERT_NAMES = {"ffn_gate_inp": None, "ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
ROPE_FREQS = "rope_freqs.weight"
# Bump when load_gguf or gguf_tokenizer changes what it makes of a file: conversions cached
# by an older version (jaxpage.loading.gguf_cache) are then made again.
CONVERSION_VERSION = 1


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of architecture `arch` ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"), or None for names that have none."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[stem]}.{suffix}"
    layer_names = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return None


def hf_expert_names(gguf_name: str, config: ModelConfig) -> list[tuple[str, int | None]]:
    """The HF names a GGUF MoE tensor holds, with the expert each is the slice of (None:
    the whole tensor, the router); [] when it is no MoE tensor."""
    parts = gguf_name.split(".")
    if (config.num_experts == 0 or len(parts) != 4 or parts[0] != "blk"
            or parts[2] not in EXPERT_NAMES or parts[3] != "weight"):
        return []
    block, projections = HF_MOE_NAMES[config.architecture]
    prefix = f"model.layers.{parts[1]}.{block}."
    which = EXPERT_NAMES[parts[2]]
    if which is None:
        return [(prefix + "gate.weight", None)]
    return [(f"{prefix}experts.{e}.{projections[which]}.weight", e)
            for e in range(config.num_experts)]


def unpermute_rope_rows(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's `LlamaModel.permute` on a q/k weight [rows, in] or bias
    [rows], rows = num_heads * head_dim.

    llama.cpp stores each head's rows as interleaved pairs (x0, x_{D/2}, x1, x_{D/2+1}, ...);
    HF keeps the two halves contiguous. Within a head, GGUF row 2*j + h is HF row
    h * D/2 + j.
    """
    rows = tensor.shape[0]
    if rows % (2 * num_heads):
        raise WeightsError(f"cannot unpermute {rows} rope rows over {num_heads} heads")
    half = rows // num_heads // 2
    rest = tensor.shape[1:]
    # [heads, D/2, 2, *rest] -> [heads, 2, D/2, *rest]
    return tensor.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(tensor.shape)


def llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, context_length: int | None
) -> dict[str, Any]:
    """The HF llama3 `rope_scaling` dict whose per-frequency divisors are `factors`.

    llama.cpp writes them (`rope_freqs.weight`, [head_dim / 2]) from factor,
    low/high_freq_factor and original_max_position_embeddings. Every Llama 3.x uses
    low = 1, high = 4; the original context is 8192 in practice, else it is solved for
    from a frequency in the smoothly interpolated band. Raises WeightsError when no
    candidate reproduces the tensor.
    """
    factors = np.asarray(factors, np.float64).reshape(-1)
    factor = float(factors.max())
    low, high = 1.0, 4.0
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    candidates = [8192.0]
    if context_length:
        candidates.append(context_length / factor)
    if factor > 1:
        # smooth band: 1 / r = (1 - s) / factor + s, s = (old / wavelen - low) / (high - low)
        smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
        band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
        candidates += [
            float(round(w * (low + s * (high - low))))
            for w, s in zip(wavelen[band], smooth[band], strict=True)
        ]

    def expected(old: float) -> np.ndarray:
        smooth = (old / wavelen - low) / (high - low)
        mid = 1 / ((1 - smooth) / factor + smooth)
        return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))

    for old in candidates:
        if factors.shape == inv_freq.shape and np.allclose(expected(old), factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(old),
            }
    raise WeightsError(
        f"{ROPE_FREQS} (factors {np.round(factors, 4).tolist()}) does not match llama3 rope "
        "scaling with low_freq_factor=1, high_freq_factor=4; this rope scaling is unsupported"
    )


def open_gguf(path: str):
    """A `gguf.GGUFReader` over `path`; FileNotFoundError / WeightsError naming the file."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct.error ...
        raise WeightsError(
            f"{path!r} is not a readable GGUF file (corrupt or truncated?): {type(e).__name__}: {e}"
        ) from e


def _field(reader, key: str, default: Any = None, required: bool = False) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise WeightsError(f"GGUF metadata has no {key!r}")
        return default
    value = field.contents()
    if isinstance(value, float):  # float32 in the file: 1e-5, not 9.999999747378752e-06
        value = float(str(np.float32(value)))
    return value


def hf_config_from_gguf(reader) -> dict[str, Any]:
    """An HF `config.json`-style dict from a GGUF file's metadata and tensor names."""
    arch = _field(reader, "general.architecture", required=True)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (as {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}

    def meta(key: str, default: Any = None, required: bool = False) -> Any:
        return _field(reader, f"{arch}.{key}", default, required)

    num_heads = meta("attention.head_count", required=True)
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts; only uniform ones are supported
        if len(set(num_kv_heads)) != 1:
            raise WeightsError(f"per-layer {arch}.attention.head_count_kv {num_kv_heads} differ")
        num_kv_heads = num_kv_heads[0]
    hidden = meta("embedding_length", required=True)
    # key_length is written whenever HF's config has an explicit head_dim; llama files
    # also carry it as the rope dimension count (llama rotates the whole head).
    head_dim = (
        meta("attention.key_length")
        or (meta("rope.dimension_count") if arch == "llama" else None)
        or hidden // num_heads
    )
    vocab_size = meta("vocab_size")
    if vocab_size is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab_size is None and "token_embd.weight" in names:
        vocab_size = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])
    context_length = meta("context_length", 2048)
    theta = float(meta("rope.freq_base", 10000.0))

    rope_scaling = None
    scaling_type = meta("rope.scaling.type") or ("linear" if meta("rope.scale_linear") else None)
    if scaling_type not in (None, "none"):
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": float(meta("rope.scaling.factor") or meta("rope.scale_linear") or 1.0),
        }
        orig = meta("rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    if ROPE_FREQS in names:
        if rope_scaling is not None:
            raise WeightsError(f"both {ROPE_FREQS} and {arch}.rope.scaling.type={scaling_type!r}")
        from gguf.quants import dequantize

        tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
        rope_scaling = llama3_rope_from_factors(
            dequantize(tensor.data, tensor.tensor_type), theta, head_dim, context_length
        )

    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    architecture = GGUF_ARCHITECTURES[arch]
    experts: dict[str, Any] = {}
    num_experts = meta("expert_count")
    if num_experts and arch == "llama":
        architecture = "MixtralForCausalLM"
        experts = {"num_local_experts": num_experts,
                   "num_experts_per_tok": meta("expert_used_count", required=True)}
    elif arch == "qwen3moe":
        num_layers = meta("block_count", required=True)
        experts = {
            "num_experts": meta("expert_count", required=True),
            "num_experts_per_tok": meta("expert_used_count", required=True),
            "moe_intermediate_size": meta("expert_feed_forward_length", required=True),
            # llama.cpp always renormalizes qwen3moe's top-k unless the file says otherwise
            "norm_topk_prob": bool(meta("expert_weights_norm", True)),
            "mlp_only_layers": [n for n in range(num_layers)
                                if f"blk.{n}.ffn_gate_inp.weight" not in names],
        }
    config = {
        **experts,
        "architectures": [architecture],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length", required=True),
        "num_hidden_layers": meta("block_count", required=True),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": context_length,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in names,
        # Qwen2 always has q/k/v biases; for llama and gemma their presence is
        # `attention_bias`.
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_gate.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos or None,
    }
    if arch in GEMMA_SLIDING_PERIOD:
        config.update(gemma_config_from_gguf(arch, meta, config))
    return config


def gemma_config_from_gguf(arch: str, meta, config: dict[str, Any]) -> dict[str, Any]:
    """The Gemma keys of an HF config from a gemma2 / gemma3 file's metadata (`meta(key,
    default)` reads "<arch>.<key>"), given the common ones in `config`."""
    num_layers, period = config["num_hidden_layers"], GEMMA_SLIDING_PERIOD[arch]
    window = meta("attention.sliding_window")  # none (or 0): every layer is global
    scalar = config["head_dim"]
    if num_layers == GEMMA_27B_LAYERS[arch]:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    gemma = {
        "sliding_window": window,
        "layer_types": ["sliding_attention" if window and (n + 1) % period else
                        "full_attention" for n in range(num_layers)],
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
    }
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": config["rope_theta"],
                **(config["rope_scaling"] or {})}
        gemma["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}}
    return gemma


def load_gguf(path: str, dtype) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, numpy params in the jaxpage layout, cast to `dtype`) from a GGUF file.

    Every tensor type `gguf.quants` can dequantize is accepted (F32, F16, BF16, Q8_0,
    Q4_0/Q4_1, K-quants ...); weights are dequantized to float32, then cast.

    Raises FileNotFoundError (no such file), WeightsError (not GGUF, corrupt, tensors that
    do not match the metadata) and ValueError (unsupported architecture or rope type).
    """
    from gguf.quants import dequantize

    reader = open_gguf(path)
    try:
        hf_config = hf_config_from_gguf(reader)
        config = ModelConfig.from_hf(hf_config)
    except ValueError as e:
        raise type(e)(f"{path}: {e}") from e
    arch = hf_config["model_type"]
    by_hf_name = {}  # HF name -> (GGUF tensor, the expert it is the slice of, or None)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # folded into config.rope
        names = hf_expert_names(tensor.name, config)
        if not names:
            hf_name = hf_tensor_name(tensor.name, arch)
            if hf_name is None:
                raise WeightsError(
                    f"{path}: GGUF tensor {tensor.name!r} is not part of a "
                    f"{config.architecture} (unknown name)"
                )
            names = [(hf_name, None)]
        by_hf_name.update((name, (tensor, expert)) for name, expert in names)
    unused = set(by_hf_name)

    def dequantized(tensor) -> np.ndarray:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        try:
            return dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise WeightsError(
                f"{path}: cannot dequantize {tensor.name!r} "
                f"({tensor.tensor_type.name}, shape {shape}): {e}"
            ) from e

    tensors = {tensor.name: tensor for tensor in reader.tensors}
    # the stacked experts are read one expert at a time: keep a layer's gate, up and down
    stacked = functools.lru_cache(maxsize=3)(lambda name: dequantized(tensors[name]))

    def get(hf_name: str) -> np.ndarray | None:
        if hf_name not in by_hf_name:
            return None
        unused.discard(hf_name)
        tensor, expert = by_hf_name[hf_name]
        array = dequantized(tensor) if expert is None else stacked(tensor.name)[expert]
        if arch in ROPE_PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in hf_name:
                array = unpermute_rope_rows(array, config.num_heads)
            elif ".self_attn.k_proj." in hf_name:
                array = unpermute_rope_rows(array, config.num_kv_heads)
        if arch in NORM_SHIFTED_ARCHITECTURES and hf_name.endswith("norm.weight"):
            array = array - 1
        return array

    try:
        params = params_from_hf_tensors(config, get, dtype)
    except WeightsError as e:
        raise WeightsError(f"{path}: {e} (names are the HF names of the GGUF tensors)") from e
    if unused:
        raise WeightsError(
            f"{path}: GGUF tensors the {config.architecture} config does not use: "
            f"{sorted(unused)[:8]}"
        )
    return config, params


# GGUF tokenizer metadata key (after "tokenizer.") -> the name transformers' GGUF tokenizer
# converter expects, split as transformers splits it: the tokenizer proper and its config.
_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type", "ggml.pre": "pre_tokenizer_type", "ggml.tokens": "tokens",
    "ggml.scores": "scores", "ggml.token_type": "token_type", "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap", "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id", "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id", "ggml.add_space_prefix": "add_prefix_space",
}
_TOKENIZER_CONFIG_KEYS = {"chat_template": "chat_template", "ggml.add_bos_token": "add_bos_token",
                          "ggml.add_eos_token": "add_eos_token"}
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(path: str):
    """The transformers tokenizer embedded in a GGUF file, chat template included when the
    file has one.

    `AutoTokenizer.from_pretrained(gguf_file=...)` reads the metadata with a reader that
    imports torch (transformers 5.x), which a JAX install need not have. The metadata is read
    here with `gguf` instead and handed to the same converter, so the tokenizer is the one
    AutoTokenizer builds (tests check token ids and chat templates against it).
    """
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerFast
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x kept the converter in integrations.ggml
        from transformers.integrations.ggml import convert_gguf_tokenizer

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    reader = GGUFReader(path)
    architecture = _field(reader, "general.architecture", required=True)

    def group(keys: dict[str, str]) -> dict[str, Any]:
        return {name: _field(reader, f"tokenizer.{key}") for key, name in keys.items()
                if f"tokenizer.{key}" in reader.fields}

    tokenizer, config = group(_TOKENIZER_KEYS), group(_TOKENIZER_CONFIG_KEYS)
    if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to sentencepiece vocabs
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
