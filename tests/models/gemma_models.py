"""Tiny random-weight Gemma 2 / Gemma 3 HF models, and a GGUF writer for them that follows
llama.cpp's convert_hf_to_gguf.py (Gemma2Model / Gemma3Model).

Importable by any test (`tests/models` is on the path of the tests in it; from elsewhere
`from models.gemma_models import ...`).
"""

from __future__ import annotations

import numpy as np

WINDOW = 16  # sliding window of every tiny model: prompts of 40-60 tokens cross it

# Head dim 16 with query_pre_attn_scalar 24 (a softmax scale that is not head_dim's),
# soft-caps small enough to bend the tiny models' scores and logits.
TINY_GEMMA_CONFIGS = {
    "gemma2": dict(model_type="gemma2", arch="Gemma2ForCausalLM", num_hidden_layers=4,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    # 6 layers: five sliding, then one global; the global rope linearly scaled
    "gemma3": dict(model_type="gemma3_text", arch="Gemma3ForCausalLM", num_hidden_layers=6,
                   query_pre_attn_scalar=24,
                   rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 50000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def build_gemma(name: str, seed: int = 0, **overrides):
    """A tiny random-weight Gemma HF model (float32, eval mode) of TINY_GEMMA_CONFIGS."""
    import transformers
    from conftest import instantiate_hf_model

    spec = {**TINY_GEMMA_CONFIGS[name], **overrides}
    model_type, arch = spec.pop("model_type"), spec.pop("arch")
    kwargs = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
                  bos_token_id=2, eos_token_id=1, pad_token_id=0)
    kwargs.update(spec)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    # Gemma's norm weights start at 0 (a scale of 1); instantiate_hf_model perturbs them.
    return instantiate_hf_model(config, arch, seed)


# ----------------------------------------------------------------------------------------
# GGUF, as llama.cpp writes it

TOKENS = [f"<t{n}>" for n in range(97)]  # the tiny vocabulary (only its size matters)


def write_gemma_gguf(model, path) -> str:
    """Write a tiny Gemma HF model as llama.cpp does: arch "gemma2" / "gemma3", llama.cpp's
    tensor names, 1 added to every norm weight, no output.weight (tied), and only the
    metadata convert_hf_to_gguf writes (no rope base for gemma2, no query_pre_attn_scalar,
    no sliding-window pattern, no local rope base: llama.cpp hard-codes those)."""
    import gguf

    cfg = model.config
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}[
        cfg.model_type.removesuffix("_text")]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    name_map = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied: llama.cpp reuses token_embd
        data = tensor.float().numpy()
        if hf_name.endswith("norm.weight"):
            data = data + 1  # convert_hf_to_gguf's Gemma norm shift
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        writer.add_tensor(name, np.ascontiguousarray(data, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
