"""Model configuration: one frozen dataclass for the Llama family, built from HF configs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# architecture name (HF `architectures[0]`) -> per-family switches
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Gemma2ForCausalLM": {},
    "Gemma3ForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's, by HF name


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) for any served model's config:
    `sliding_window` applies to the layers `layer_types` marks "sliding_attention", or to
    every layer when the config has no `layer_types` (Mistral)."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * config.num_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_theta` + `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Llama-family transformer.

    Frozen and hashable, so it can be a static argument of `jax.jit`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False  # Llama with mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope
    # Sliding-window attention: the layers `layer_types` marks "sliding_attention" (every
    # layer when layer_types is None) see only the last `sliding_window` positions.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" | "sliding_attention"
    # Gemma 2 / 3
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (else head_dim)
    rope_local: RopeConfig | None = None  # the sliding layers' rotary embedding (Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    # mixture of experts (Mixtral, Qwen3-MoE); num_experts 0 = a dense MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every this-th layer is MoE (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (Qwen3-MoE)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(
                    LAYER_TYPES):
                raise ValueError(f"ModelConfig.layer_types must be {self.num_layers} of "
                                 f"{LAYER_TYPES}, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("ModelConfig.layer_types has sliding layers but "
                                 "sliding_window is not set")
        if self.num_experts and not (
                1 <= self.num_experts_per_tok <= self.num_experts
                and self.moe_intermediate_size >= 1 and self.decoder_sparse_step >= 1):
            raise ValueError(
                f"ModelConfig with {self.num_experts} experts needs 1 <= num_experts_per_tok "
                f"<= num_experts, moe_intermediate_size >= 1 and decoder_sparse_step >= 1; got "
                f"{self.num_experts_per_tok}, {self.moe_intermediate_size}, "
                f"{self.decoder_sparse_step}")
        for rope in (self.rope, self.rope_local or self.rope):
            if rope.rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope type {rope.rope_type!r}; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {self.hidden_act!r}; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for a full-attention layer."""
        return layer_windows(self)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` routes each token to experts (else its MLP is dense), by HF
        Qwen3-MoE's rule; every layer of a Mixtral."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied; every expert counted, not
        just the ones a token runs)."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # + router
        mlps = sum(moe_mlp if self.is_moe_layer(n) else dense_mlp
                   for n in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * attention + mlps + h + head

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Build from a `transformers.PretrainedConfig` or its `config.json` dict."""
        cfg: Mapping[str, Any] = (
            hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        )
        architectures = cfg.get("architectures") or []
        if not architectures:
            model_type = cfg.get("model_type", "")
            architectures = [
                a for a in SUPPORTED_ARCHITECTURES if a.lower().startswith(model_type.lower())
            ] or [f"<model_type {model_type!r}>"]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window")
        if not (architecture in _WINDOWED_ARCHITECTURES or cfg.get("use_sliding_window")):
            window = None
        extra = _FAMILY_FIELDS.get(architecture, lambda cfg: {})(cfg)
        fields = dict(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            sliding_window=window or None,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.get("qkv_bias", False) or attention_bias,
            o_bias=attention_bias and architecture == "LlamaForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family.get("qk_norm", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        fields.update(extra)
        return cls(**fields)


# Architectures whose HF config's `sliding_window` always applies (others need
# `use_sliding_window`, as Qwen2's does).
_WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM")


def _gemma_fields(cfg: Mapping[str, Any], gemma3: bool) -> dict[str, Any]:
    """Gemma 2 / 3 fields of an HF config (layer_types, soft-caps, scalars, local rope), with
    transformers' defaults for keys a config.json leaves out (most Hub configs predate
    `layer_types` and Gemma 3's per-layer-type `rope_parameters`)."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma attention (EmbeddingGemma) is not supported")
    num_layers = cfg["num_hidden_layers"]
    # every `pattern`-th layer is global, the others slide (Gemma 2: 2, Gemma 3: 6)
    pattern = (cfg.get("sliding_window_pattern") or 6) if gemma3 else 2
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (n + 1) % pattern else "full_attention" for n in range(num_layers)]
    fields: dict[str, Any] = dict(
        layer_types=tuple(layer_types),
        hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcap=cfg.get("final_logit_softcapping", None if gemma3 else 30.0),
        # Gemma 3's attention ignores `attn_logit_softcapping` (transformers passes it no
        # softcap), so it is dropped here too.
        attn_logit_softcap=None if gemma3 else cfg.get("attn_logit_softcapping", 50.0),
        o_bias=bool(cfg.get("attention_bias", False)),
    )
    if gemma3:
        fields["rope"], fields["rope_local"] = _gemma3_ropes(cfg)
    return fields


def _gemma3_ropes(cfg: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rotary embeddings of a Gemma 3 config: `rope_parameters` keyed by
    layer type (transformers 5), or the older `rope_theta` (default 1e6) + `rope_scaling`
    for the global layers and `rope_local_base_freq` (default 1e4) for the sliding ones."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params or not set(params) <= set(LAYER_TYPES):
        params = {"full_attention": {**(cfg.get("rope_scaling") or {}), **params}}
    full = {"rope_theta": cfg.get("rope_theta", 1e6), **(params.get("full_attention") or {})}
    local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4),
             **(params.get("sliding_attention") or {})}
    context = {"max_position_embeddings": cfg.get("max_position_embeddings", 2048)}
    return (_rope_from_hf({**context, "rope_parameters": full}),
            _rope_from_hf({**context, "rope_parameters": local}))


def _mixtral_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Mixtral's experts: every layer is MoE, each expert `intermediate_size` wide, and the
    top-k routing weights are always renormalized."""
    return dict(num_experts=cfg["num_local_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)


def _qwen3_moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's experts (`intermediate_size` is the dense layers' width). The Hub's
    config.json says `num_experts`; transformers 5 saves it as `num_local_experts`."""
    return dict(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))


# architecture -> the ModelConfig fields its HF config adds to the common ones
_FAMILY_FIELDS = {
    "Gemma2ForCausalLM": lambda cfg: _gemma_fields(cfg, gemma3=False),
    "Gemma3ForCausalLM": lambda cfg: _gemma_fields(cfg, gemma3=True),
    "MixtralForCausalLM": _mixtral_fields,
    "Qwen3MoeForCausalLM": _qwen3_moe_fields,
}


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    # transformers >= 5 folds everything into `rope_parameters`; older ones use
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, [head_dim // 2] float32.

    Computed in float32 exactly the way HF transformers does, so positions far into a
    sequence rotate by bit-identical angles.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        # low frequencies (long wavelengths) are scaled by 1/factor, high ones kept
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv
