"""Shared fixtures: tiny random-weight HF models saved to temp dirs, and a naive paged runner."""

from __future__ import annotations

import ctypes
import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run, shared by its pytest-xdist workers
# (`pytest_configure` names it before they start): many tests step the same tiny models at the
# same shapes, and a step found there loads in milliseconds instead of compiling. Only the test
# processes read it (the variable is ours, not JAX's, so the CLIs and servers the tests start
# compile as users' do); it is removed when the run ends.
_CACHE_VARIABLE = "JAXPAGE_TEST_COMPILE_CACHE"
if os.environ.get(_CACHE_VARIABLE):
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    """The run's compilation cache (see above): made by the process that starts the run (the
    xdist controller, or the only process), inherited by the workers it spawns."""
    if hasattr(config, "workerinput") or os.environ.get(_CACHE_VARIABLE):
        return
    import tempfile

    config._jaxpage_cache = tempfile.mkdtemp(prefix="jaxpage-test-xla-")
    os.environ[_CACHE_VARIABLE] = config._jaxpage_cache
    jax.config.update("jax_compilation_cache_dir", config._jaxpage_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    cache = getattr(config, "_jaxpage_cache", None)
    if cache:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
        os.environ.pop(_CACHE_VARIABLE, None)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one pytest-xdist worker per core this process may run
    on, at most 4 and one per 6 GiB of memory (a worker's memory reached 11 GiB while it ran
    a Pallas interpreter through the engine, 5-7 GiB in the kernel cases, and the subprocess
    tests start 8-device JAX processes beside it). Two workers took the default suite on a
    2-core x86-64 CPU from 34 to 27 minutes: its tests are mostly single-threaded Python and XLA
    compilations."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(4, cores or 1, int(memory_gib // 6)))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
    """Drop every compiled executable after each test module, and hand the memory freed back
    to the OS. Each executable XLA:CPU loads holds a few memory mappings, and one process
    running the whole suite (~1,000 tests, several thousand executables) otherwise reaches the
    kernel's vm.max_map_count (65,530 here) and segfaults inside the next compilation. And
    glibc keeps what a module freed (engines' pools and weights) in its heap: a slow-suite
    worker held 15 GB after its last test, and the sanitizer check beside it, in a 24 GB
    machine without swap, ran past 1,700 s thrashing instead of its 4 minutes."""
    yield
    jax.clear_caches()
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    """glibc's malloc_trim(0): return the heap's free memory to the OS (elsewhere, nothing)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

# Tiny configs of every supported architecture. Head counts are chosen to cover GQA with
# 3 query heads per KV head, an odd head count, MHA, and tied and untied embeddings.
TINY_CONFIGS = {
    "llama": dict(arch="LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=2,
                  tie_word_embeddings=False),
    "llama3_rope": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=4,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64},
                        max_position_embeddings=1024),
    "smollm2": dict(arch="LlamaForCausalLM", num_attention_heads=9, num_key_value_heads=3,
                    hidden_size=72, tie_word_embeddings=True, rope_theta=100000.0),
    "mistral": dict(arch="MistralForCausalLM", num_attention_heads=6, num_key_value_heads=2),
    "qwen2": dict(arch="Qwen2ForCausalLM", num_attention_heads=3, num_key_value_heads=1,
                  hidden_size=48, tie_word_embeddings=True),
    "qwen3": dict(arch="Qwen3ForCausalLM", num_attention_heads=6, num_key_value_heads=2,
                  head_dim=16, tie_word_embeddings=False),
}


def build_hf_model(name: str, seed: int = 0, **overrides):
    """A tiny random-weight HF model (float32, eval mode) of one of TINY_CONFIGS."""
    import transformers

    spec = dict(TINY_CONFIGS[name])
    spec.update(overrides)
    arch = spec.pop("arch")
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[arch]
    rope_theta = spec.pop("rope_theta", 10000.0)
    rope_scaling = spec.pop("rope_scaling", None)
    kwargs = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    kwargs.update(spec)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    params = {"rope_theta": rope_theta, "rope_type": "default", **(rope_scaling or {})}
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = params
    else:
        config.rope_theta = rope_theta
        config.rope_scaling = rope_scaling
    return instantiate_hf_model(config, arch, seed)


def instantiate_hf_model(config, arch: str, seed: int):
    """HF transformers' `arch` (e.g. "LlamaForCausalLM") of `config`, float32 in eval mode,
    with seeded random weights. Random init leaves norms at their identity and biases at 0:
    both are perturbed so that they are exercised."""
    import torch
    import transformers

    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    model.generation_config.eos_token_id = None  # hf_greedy passes EOS explicitly
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def build_tiny_model(name: str, seed: int = 0, **overrides):
    """A tiny random-weight HF model of any family by its name: TINY_CONFIGS here, the Gemma
    and MoE ones in tests/models."""
    if name in TINY_CONFIGS:
        return build_hf_model(name, seed, **overrides)
    from models.gemma_models import TINY_GEMMA_CONFIGS, build_gemma
    from models.moe_models import build_moe_model

    build = build_gemma if name in TINY_GEMMA_CONFIGS else build_moe_model
    return build(name, seed, **overrides)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Factory: save a tiny HF model (`build_tiny_model`: any family) to a temp dir once per
    (name, seed, config overrides); returns (dir, model)."""
    cache = {}

    def make(name: str, seed: int = 0, **overrides):
        key = (name, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            model = build_tiny_model(name, seed, **overrides)
            path = tmp_path_factory.mktemp(f"hf_{name}_{seed}")
            model.save_pretrained(path, safe_serialization=True)
            cache[key] = (str(path), model)
        return cache[key]

    return make


def slow_unless(by_default: bool, *values):
    """A pytest case of `values` that the default suite runs when `by_default`, and only the
    slow tests otherwise."""
    return pytest.param(*values, marks=() if by_default else pytest.mark.slow)


def add_due(engine, pending: list, step: int) -> None:
    """Add the workload items `(request_id, prompt, params, step to add it at)` due by
    `step` to `engine` (beam searches by their BeamSearchParams) and drop them from
    `pending`."""
    from jaxpage import BeamSearchParams

    for item in [w for w in pending if w[3] <= step]:
        request_id, prompt, params, _ = item
        if isinstance(params, BeamSearchParams):
            engine.add_beam_request(request_id, prompt, params)
        else:
            engine.add_request(request_id, prompt, params)
        pending.remove(item)


def hf_logits(model, token_ids) -> np.ndarray:
    """HF transformers' float32 logits [len, vocab] for one sequence (the oracle)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def hf_greedy(model, prompt_ids, max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """HF transformers `generate` greedy continuation (generated ids only).

    With stop_at_eos False, EOS is an ordinary token (the engine's ignore_eos).
    """
    import torch

    eos = model.config.eos_token_id if stop_at_eos else None
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


# Training text for the byte-level BPE: multi-byte characters (2, 3 and 4 bytes in UTF-8)
# frequent enough that merges build tokens ending or starting inside a character.
CORPUS = (
    "The café on the corner serves naïve tourists crêpes and café au lait.",
    "日本語のテキストも少し入れます。日本語は楽しい。",
    "Emoji: 😀 😃 😄 😁 😆 😅 😂 🙂 😀😀 are fun.",
    "Ünïcödé wörds: façade, jalapeño, Zürich, smörgåsbord, déjà vu, naïve café.",
    "Plain English text about the quick brown fox who jumps over the lazy dog again and again.",
    "Numbers 12345 and symbols €100 £50 ¥1000 — “quotes” and ‘apostrophes’…",
) * 4
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the tiny test models' pad, bos, eos

def byte_level_bpe_tokenizer(vocab_size: int = 400):
    """A GPT-2 style byte-level BPE trained on CORPUS, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>",
                                        clean_up_tokenization_spaces=False)
    assert len(tokenizer) == vocab_size
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    return tokenizer


def byte_bpe_llm(directory, **engine):
    """An LLM over a tiny random Llama of `byte_level_bpe_tokenizer`'s vocabulary (saved to
    `directory`), with that tokenizer: its tokens split multi-byte characters. `engine`:
    EngineConfig fields."""
    from jaxpage import LLM

    tokenizer = byte_level_bpe_tokenizer()
    build_hf_model("llama", 0, vocab_size=len(tokenizer)).save_pretrained(
        directory, safe_serialization=True)
    return LLM(str(directory), tokenizer=tokenizer, **engine)
