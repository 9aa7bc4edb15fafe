"""Tiny random-weight mixture-of-experts HF models (Mixtral, Qwen3-MoE), float32, for tests.

Importable from any test: `from moe_models import ...` beside it in tests/models, and
`from models.moe_models import ...` elsewhere (pytest puts tests/, the rootdir conftest's
directory, on sys.path).
"""

from __future__ import annotations

# name -> (HF architecture, config overrides). 8 experts, top 2 or 3; Qwen3-MoE with and
# without renormalized top-k weights, and one whose layer 0 (mlp_only_layers) and layer 2
# (decoder_sparse_step 2 makes layers 1 and 3 MoE) have dense MLPs.
MOE_CONFIGS = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                           num_attention_heads=6, num_key_value_heads=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=3,
                                              moe_intermediate_size=24, norm_topk_prob=True,
                                              num_attention_heads=6, num_key_value_heads=2,
                                              head_dim=16)),
    "qwen3_moe_unnormed": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=24,
                                                       norm_topk_prob=False,
                                                       num_attention_heads=4,
                                                       num_key_value_heads=4,
                                                       tie_word_embeddings=True)),
    "qwen3_moe_sparse": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=24,
                                                     norm_topk_prob=True, num_hidden_layers=4,
                                                     decoder_sparse_step=2,
                                                     mlp_only_layers=[0, 3],
                                                     num_attention_heads=6,
                                                     num_key_value_heads=2)),
}
_MODEL_TYPES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}


def build_moe_model(name: str, seed: int = 0, **overrides):
    """A tiny random-weight HF MoE model (float32, eval mode) of one of MOE_CONFIGS.

    Norms are perturbed away from 1 (conftest.instantiate_hf_model) and the routers
    scaled up, so routing is decided by clear margins rather than near-ties a float32
    rounding could flip.
    """
    import torch
    import transformers
    from conftest import instantiate_hf_model

    arch, spec = MOE_CONFIGS[name]
    spec = {**spec, **overrides}
    kwargs = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    kwargs.update(spec)
    config = transformers.AutoConfig.for_model(_MODEL_TYPES[arch], **kwargs)
    config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "default"}
    model = instantiate_hf_model(config, arch, seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".gate.weight"):  # the routers
                p.mul_(20.0)
    return model
