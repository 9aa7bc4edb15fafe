"""A GGUF model is converted once into the cache directory and read from there afterwards
(jaxpage.loading.gguf_cache): same params bit for bit, no dequantizing on the second load,
a changed file converted again, a damaged or half-written entry rebuilt, never a crash."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import gguf
import gguf.quants
import pytest
from test_gguf_and_checkpoint import assert_params_equal, default_gguf, write_gguf

import jaxpage.loading.gguf as gguf_loading
from jaxpage.loading import load_model
from jaxpage.loading.checkpoint import CONFIG_FILE, is_checkpoint
from jaxpage.loading.gguf_cache import SOURCE_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = "hello world, he said!"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory for this test (JAXPAGE_CACHE_DIR)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("JAXPAGE_CACHE_DIR", str(root))
    return root


@pytest.fixture
def dequantize_calls(monkeypatch):
    """Counts calls of the real `gguf.quants.dequantize` (load_gguf looks it up per call)."""
    calls = []
    real = gguf.quants.dequantize

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    return calls


def entries(cache, dtype="float32") -> list[str]:
    return sorted(glob.glob(str(cache / "gguf" / "*" / f"{dtype}-*")))


def tiny_gguf(hf_model_dir, tmp_path, name="m.gguf", seed=0, qtype=None) -> str:
    _, model = hf_model_dir("llama", seed)
    return write_gguf(model, tmp_path / name, qtype=qtype)


def assert_same_model(loaded, expected):
    (config, params, tokenizer), (config2, params2, tokenizer2) = loaded, expected
    assert config == config2
    assert_params_equal(params, params2)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == tokenizer2(TEXT)["input_ids"] and tokenizer.decode(ids) == TEXT


def test_second_load_reads_the_cached_checkpoint(hf_model_dir, tmp_path, cache,
                                                 dequantize_calls):
    file = tiny_gguf(hf_model_dir, tmp_path)
    uncached = load_model(file, "float32", cache_gguf=False)
    assert dequantize_calls and not cache.exists()  # cache_gguf=False writes nothing
    dequantize_calls.clear()

    first = load_model(file, "float32")
    assert dequantize_calls, "the first load converts the GGUF file"
    [entry] = entries(cache)
    assert is_checkpoint(entry) and os.path.isfile(os.path.join(entry, SOURCE_FILE))
    assert_same_model(first, uncached)

    dequantize_calls.clear()
    second = load_model(file, "float32")
    assert not dequantize_calls, "the second load must not dequantize"
    assert_same_model(second, uncached)
    assert entries(cache) == [entry]

    # another dtype is another entry, and a cast of the same weights
    bf16 = load_model(file, "bfloat16")
    assert len(entries(cache, "bfloat16")) == 1
    dequantize_calls.clear()
    assert_same_model(load_model(file, "bfloat16"), bf16)
    assert not dequantize_calls
    assert_same_model(bf16, load_model(file, "bfloat16", cache_gguf=False))


@pytest.mark.parametrize("change", ["mtime", "size"])
def test_changed_gguf_is_converted_again(change, hf_model_dir, tmp_path, cache,
                                         dequantize_calls):
    file = tiny_gguf(hf_model_dir, tmp_path)
    load_model(file, "float32")
    [old_entry] = entries(cache)
    stat = os.stat(file)
    if change == "mtime":  # other weights, same size: only the mtime tells
        tiny_gguf(hf_model_dir, tmp_path, seed=1)
        assert os.path.getsize(file) == stat.st_size
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    else:  # other bytes, same mtime: only the size tells
        tiny_gguf(hf_model_dir, tmp_path, qtype=gguf.GGMLQuantizationType.F16)
        assert os.path.getsize(file) != stat.st_size
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    dequantize_calls.clear()
    loaded = load_model(file, "float32")
    assert dequantize_calls, "a changed file is converted again"
    assert_same_model(loaded, load_model(file, "float32", cache_gguf=False))
    [new_entry] = entries(cache)  # the stale entry is gone
    assert new_entry != old_entry
    dequantize_calls.clear()
    assert_same_model(load_model(file, "float32"), loaded)
    assert not dequantize_calls


def _truncate_largest_param_file(entry):
    files = [p for p in glob.glob(os.path.join(entry, "params", "**", "*"), recursive=True)
             if os.path.isfile(p)]
    largest = max(files, key=os.path.getsize)
    size = os.path.getsize(largest)
    with open(largest, "r+b") as f:
        f.truncate(size // 2)


def _drop_source_record(entry):
    os.remove(os.path.join(entry, SOURCE_FILE))


def _garble_checkpoint_record(entry):
    # same size, so only loading the checkpoint itself can tell
    path = os.path.join(entry, CONFIG_FILE)
    size = os.path.getsize(path)
    with open(path, "w") as f:
        f.write("x" * size)


def _other_source_record(entry):
    path = os.path.join(entry, SOURCE_FILE)
    with open(path) as f:
        record = json.load(f)
    record["identity"]["gguf_size"] += 1
    with open(path, "w") as f:
        json.dump(record, f)


@pytest.mark.parametrize("damage", [_truncate_largest_param_file, _drop_source_record,
                                    _garble_checkpoint_record, _other_source_record])
def test_damaged_entry_is_rebuilt(damage, hf_model_dir, tmp_path, cache, dequantize_calls):
    file = tiny_gguf(hf_model_dir, tmp_path)
    first = load_model(file, "float32")
    [entry] = entries(cache)
    damage(entry)
    dequantize_calls.clear()
    with pytest.warns(UserWarning, match="damaged cached conversion"):
        rebuilt = load_model(file, "float32")
    assert dequantize_calls
    assert_same_model(rebuilt, first)
    assert entries(cache) == [entry]
    dequantize_calls.clear()
    assert_same_model(load_model(file, "float32"), first)
    assert not dequantize_calls


def test_killed_conversion_leaves_no_entry(hf_model_dir, tmp_path, cache, dequantize_calls):
    """A process killed after writing the checkpoint but before the rename leaves only a
    temporary directory: the next load converts again and removes it."""
    file = tiny_gguf(hf_model_dir, tmp_path)
    code = ("import os, jaxpage.loading.checkpoint as c\n"
            "real = c.save_checkpoint\n"
            "def save_then_die(*a, **k):\n"
            "    real(*a, **k)\n"
            "    os._exit(9)  # as SIGKILL: no finally, no cleanup\n"
            "c.save_checkpoint = save_then_die\n"
            "from jaxpage.loading import load_model\n"
            f"load_model({file!r}, 'float32')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 9, done.stderr[-2000:]
    assert entries(cache) == []
    [source_dir] = glob.glob(str(cache / "gguf" / "*"))
    [leftover] = os.listdir(source_dir)
    assert leftover.startswith(".tmp-")

    dequantize_calls.clear()
    loaded = load_model(file, "float32")
    assert dequantize_calls
    assert_same_model(loaded, load_model(file, "float32", cache_gguf=False))
    assert [os.path.basename(e) for e in entries(cache)] == os.listdir(source_dir)


def test_unwritable_cache_costs_only_the_speed_up(hf_model_dir, tmp_path, monkeypatch):
    file = tiny_gguf(hf_model_dir, tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("JAXPAGE_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="could not cache"):
        loaded = load_model(file, "float32")
    assert_same_model(loaded, load_model(file, "float32", cache_gguf=False))


def test_cache_flag_and_directory(monkeypatch, tmp_path):
    from jaxpage.cache_dir import cache_root
    from jaxpage.engine_args import engine_config
    from jaxpage.generate import parse_args

    assert engine_config(parse_args([])).cache_gguf is True
    assert engine_config(parse_args(["--no-cache-gguf"])).cache_gguf is False
    monkeypatch.delenv("JAXPAGE_CACHE", raising=False)
    monkeypatch.setenv("JAXPAGE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == str(tmp_path / "c")
    monkeypatch.delenv("JAXPAGE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "jaxpage")


def test_llm_passes_the_flag(hf_model_dir, tmp_path, cache, monkeypatch):
    from jaxpage import LLM

    calls = []
    real = gguf_loading.load_gguf
    monkeypatch.setattr(gguf_loading, "load_gguf", lambda *a: calls.append(a) or real(*a))
    file = tiny_gguf(hf_model_dir, tmp_path)
    LLM(file, num_blocks=8, attention_backend="jnp", cache_gguf=False)
    assert calls and not (cache / "gguf").exists()
    LLM(file, num_blocks=8, attention_backend="jnp")
    assert len(entries(cache)) == 1
    calls.clear()
    LLM(file, num_blocks=8, attention_backend="jnp")
    assert not calls


@pytest.mark.slow
def test_default_model_cached_conversion_is_bit_identical(cache, dequantize_calls, request):
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("slow (real 135M model): run with -m slow")
    file = default_gguf()
    first = load_model(file, "float32")
    dequantize_calls.clear()
    second = load_model(file, "float32")
    assert not dequantize_calls
    assert_same_model(second, first)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    from jaxpage.llm import chat_token_ids

    assert chat_token_ids(second[2], messages) == chat_token_ids(first[2], messages)
