"""The benchmark scripts' core functions on a tiny random model (accounting and invariants),
and the scripts' layout: each one answers --help, and only lab probes touch sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpage.attention import kv_bytes_per_block

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_common  # noqa: E402
import bench_host_cache  # noqa: E402
import bench_memory  # noqa: E402
import bench_prefix  # noqa: E402
import bench_swap  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def tiny():
    return bench_common.tiny_model()


@pytest.fixture(scope="module")
def memory_results(tiny):
    model, params = tiny
    spec = bench_memory.TraceSpec(num_requests=12, prompt_median=24, output_median=40, seed=3)
    return bench_memory.compare(model, params, None, spec, block_size=BLOCK, num_blocks=48,
                                max_model_len=256, max_num_seqs=32,
                                max_num_batched_tokens=256, check=True)


def test_trace_is_seeded_and_bounded():
    spec = bench_memory.TraceSpec(num_requests=50, rate=2.0, seed=1)
    a = bench_memory.make_trace(spec, 512, 256)
    assert a == bench_memory.make_trace(spec, 512, 256)
    prompts, outs, arrivals = a
    for p, o in zip(prompts, outs, strict=True):
        assert len(p) + o <= 256 and len(p) >= 4 and o >= 4
    assert arrivals[0] == 0 and all(np.diff(arrivals) >= 0) and arrivals[-1] > 0


def test_memory_accounting_matches_requests(memory_results):
    for policy, r in memory_results.items():
        timeline = r["run"]["timeline"]
        assert timeline
        for snap in timeline:
            # real tokens from the allocator == from the requests' lengths
            assert snap["real"] == snap["real_from_requests"], policy
            # no sharing (prefix caching off): the blocks the allocator counts as used (its
            # free lists) are exactly those the running tables hold; real + reserved + tail
            # slots add up to the tables by kv_snapshot's construction, so that is not checked
            assert snap["allocated"] == snap["table_slots"], policy
            assert snap["allocated"] <= 48 * BLOCK
    assert memory_results["paged"]["reserved_share"] == 0


def test_policies_ordered_and_outputs_identical(memory_results):
    paged, oracle, mx = (memory_results[p] for p in ("paged", "oracle", "max"))
    for key in ("real_share", "real_share_by_step"):
        assert paged[key] >= oracle[key] >= mx[key], key
    assert paged["peak_running"] > mx["peak_running"]
    tokens = paged["run"]["tokens"]
    assert oracle["run"]["tokens"] == tokens and mx["run"]["tokens"] == tokens
    spec = bench_memory.TraceSpec(num_requests=12, prompt_median=24, output_median=40, seed=3)
    _, outs, _ = bench_memory.make_trace(spec, 512, 256)
    assert [len(t) for t in tokens] == outs
    assert all(r["useful_tokens"] == sum(outs) for r in memory_results.values())


def test_prefix_caching_core(tiny):
    model, params = tiny

    def new_engine(caching):
        return bench_common.make_engine(model, params, None, "paged",
                                        enable_prefix_caching=caching, block_size=BLOCK,
                                        num_blocks=256, max_model_len=512, max_num_seqs=8,
                                        max_num_batched_tokens=512)

    res = bench_prefix.compare(new_engine, prefix_len=128, num_requests=3, turns=3,
                               system_len=32, max_tokens=6, warmup=False)
    head = bench_prefix.report(res, BLOCK)
    assert head["shared_identical"] and head["chat_identical"]
    assert head["salt_isolated"] and head["salt_own_hits"]
    on, off = res["shared_on"], res["shared_off"]
    assert all(r["cached"] == 0 for r in off) and on[0]["cached"] == 0
    assert all(r["cached"] == 128 for r in on[1:])  # the prefix's 8 full blocks
    assert all(r["computed"] == r["prompt"] - r["cached"] for r in on + off)
    # prefill tokens computed drop by exactly the cached share
    warm_on, warm_off = bench_prefix.summary(on[1:]), bench_prefix.summary(off[1:])
    assert warm_on["computed"] == warm_off["computed"] - 128 * 2
    assert head["shared_computed_reduction"] == pytest.approx(head["shared_hit_rate"])
    assert all(r["cached"] > 0 for r in res["chat_on"][1:])


def test_swap_bench_core(tiny):
    """The measured rows account for every byte; the worked-out rows follow the formula."""
    model, params = tiny
    row = bench_swap.measure(model, params, 8, 64, repeats=1)
    c = model.config
    assert row["blocks"] == 8 and row["block_bytes"] == 2 * c.num_layers * 8 * c.num_kv_heads * (
        c.head_dim) * 4
    assert row["bytes"] == row["blocks"] * row["block_bytes"]
    assert row["out_s"] > 0 and row["in_s"] > 0 and row["prefill_s"] > 0
    h200 = bench_swap.PLATFORMS["H200 (PCIe Gen5 x16)"]
    w = bench_swap.worked_out(h200, 16, 1024)
    assert w["block_bytes"] == 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB of bf16 K and V
    assert w["swap_s"] == pytest.approx(2 * 2**21 / 55e9 + 4 * 2**21 / 4.8e12)
    flops = 2 * 8.03e9 + 2 * 32 * 32 * 128 * 1024
    assert w["recompute_s"] == pytest.approx(16 * flops / (989e12 * 0.5))


def test_host_cache_bench_core(tiny):
    model, params = tiny
    c = model.config
    host_bytes = 256 * kv_bytes_per_block(c.num_layers, BLOCK, c.num_kv_heads, c.head_dim,
                                          np.float32)

    def new_engine(host_tier):
        return bench_common.make_engine(model, params, None, "paged",
                                        enable_prefix_caching=True, block_size=BLOCK,
                                        num_blocks=25, swap_space=host_bytes if host_tier else 0,
                                        max_model_len=512, max_num_seqs=8,
                                        max_num_batched_tokens=512)

    res = bench_host_cache.compare(new_engine, warmup=False, conversations=4, turns=3,
                                   system_len=64, max_tokens=6)
    head = bench_host_cache.report(res)
    assert head["identical"] and head["host_hit_share"] > 0
    assert head["computed_on"] < head["computed_off"]
    for rows in (res["on"], res["off"]):
        assert all(r["computed"] == r["prompt"] - r["cached"] for turn in rows for r in turn)
    assert all(r["host"] == 0 for turn in res["off"] for r in turn)
    assert res["stats_on"]["prefix_cache_host_hits"] == sum(
        r["host"] for turn in res["on"] for r in turn)


def test_decode_peer_protocol(tiny):
    """bench_decode_peer's one measuring function, `bench_common.decode_rounds` (what vLLM's
    venv runs too, through vllm_peer.py), on a real engine through vLLM's calling convention
    (token-id prompt dicts, a SamplingParams class): every generation of the length asked (it
    stops the run otherwise), the warm-up round dropped; and a step from the medians,
    hand-worked."""
    import bench_decode_peer

    from jaxpage import LLM, SamplingParams

    model, params = tiny
    llm = LLM(model, params=params, max_model_len=256, max_num_seqs=8, num_blocks=64,
              block_size=BLOCK, enable_prefix_caching=False)
    requests = [{"prompt_token_ids": [5 + i, 7, 9, 11]} for i in range(4)]
    out = bench_common.decode_rounds(llm, SamplingParams, requests, [1, 4], (3, 9), rounds=2)
    assert sorted(out) == [1, 4]
    for times in out.values():
        assert len(times["short"]) == len(times["long"]) == 2
        assert min(times["short"] + times["long"]) > 0
    # medians 2 s and 6 s: 4 s over the 128 tokens between 32 and 160
    assert bench_decode_peer.step_ms({"short": [3, 1, 2], "long": [7, 5, 6]}, 32, 160) == (
        pytest.approx(31.25))


def test_decode_step_plumbing(tiny):
    """bench_common's decode-step helpers on a tiny engine: the step's inputs (scattered, whole
    blocks), the bytes and FLOPs its bound is built from, the alternation of a runner
    attribute (restored after) and the forward's arguments."""
    from jaxpage import LLM

    model, params = tiny
    llm = LLM(model, params=params, max_model_len=256, max_num_seqs=8, num_blocks=64,
              block_size=BLOCK, enable_prefix_caching=False)
    runner = llm.engine.runner
    seqs = bench_common.decode_seqs(runner, 3, 20)
    blocks = [b for seq in seqs for b in seq.block_table]
    assert len(seqs) == 3 and len(blocks) == 3 * 2 and len(set(blocks)) == 6 and 0 not in blocks
    weights, kv, flops = bench_common.step_bytes_and_flops(llm, 3, 20)
    assert kv == 3 * 21 * runner.block_bytes / runner.block_size
    assert weights > 0 and flops == bench_common.forward_flops(model.config, 3, 20, True)
    buckets = runner.decode_buckets
    own, other = bench_common.alternating_step_seconds(llm, 3, 20, "decode_buckets",
                                                       (buckets, [max(buckets)]), rounds=2)
    assert own > 0 and other > 0 and runner.decode_buckets == buckets
    assert len(bench_common.forward_args(runner, seqs)) == 7
    prompts, outs = bench_common.make_trace(10, 0, 512)
    assert (prompts, outs) == bench_common.make_trace(10, 0, 512)
    assert all(8 <= len(p) <= 512 and 8 <= o <= 256 for p, o in zip(prompts, outs, strict=True))

def script_paths() -> list[Path]:
    """Every runnable script: the benchmarks and checks in scripts/, the probes in scripts/lab/
    (bench_common is their shared module, not a script)."""
    return sorted(p for p in [*SCRIPTS.glob("*.py"), *SCRIPTS.glob("lab/*.py")]
                  if p.name != "bench_common.py")


@pytest.mark.parametrize("script", script_paths(), ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_script_answers_help(script):
    """`python scripts/X.py --help` (and scripts/lab/Y.py) imports what the script imports,
    from the directory a user runs it in: a script moved or a helper renamed fails here."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=300, cwd=SCRIPTS.parent, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout


def test_only_lab_probes_touch_sys_path():
    """A benchmark in scripts/ imports bench_common as `python scripts/X.py` finds it (its own
    directory is on sys.path); only scripts/lab/'s probes insert scripts/ to find it."""
    inserting = [p.name for p in SCRIPTS.glob("*.py") if "sys.path.insert" in p.read_text()]
    assert not inserting, f"scripts outside scripts/lab/ that edit sys.path: {inserting}"


@pytest.fixture(scope="module")
def host_bench_model(tmp_path_factory):
    """bench_host's model at 2 layers, written as an HF directory and loaded as the bench
    loads it: (directory, model, params, tokenizer)."""
    import bench_host

    path = bench_common.write_hf_llama(str(tmp_path_factory.mktemp("host_bench")),
                                       num_hidden_layers=2)
    return (path, *bench_host.load(path))


@pytest.mark.parametrize("step_kind", ["decode", "final", "penalized", "mixed"])
@pytest.mark.parametrize("kind", ["host", "model"])
def test_host_bench_steps(host_bench_model, kind, step_kind):
    """bench_host's timed steps at 1 and 4 sequences: each step's phases, read from the
    engine, add up to no more than its wall time; every decoding request gets one token a
    step, streamed but in "final" steps (no output before the end); a mixed step's prompt
    ends every 4 steps; the no-device runner's draws are the outputs' tokens; the engine's
    stats carry the same phases."""
    import bench_host

    _, model, params, tokenizer = host_bench_model
    for n in (1, 4):
        records, engine = bench_host.run_case(kind, step_kind, model, params, tokenizer, n,
                                              chunk=16, warm=2, steps=8)
        assert len(records) == 8
        for r in records:
            phases = [r[p] for p in bench_host.COLUMNS]
            assert min(phases) >= -1e-9 and 0 < sum(phases) <= r["wall"]
            assert r["compiles"] == 0
            assert r["decoded"] == n
            decoded = {rid: t for rid, t in r["tokens"].items() if rid.startswith("d")}
            if step_kind == "final":
                assert decoded == {}
                continue
            assert sorted(decoded) == sorted(f"d{i}" for i in range(n))
            assert all(len(t) == 1 for t in decoded.values())
        prompts = [rid for r in records for rid in r["tokens"] if rid.startswith("p")]
        assert len(prompts) == (2 if step_kind == "mixed" else 0) == len(set(prompts))
        runner = engine.runner
        if kind == "host":
            assert all(r["prepare"] == r["dispatch"] == r["wait"] == 0 for r in records)
            for i in range(n):  # a draw is the token at its position, prompt of 16 tokens
                out = engine.requests[f"d{i}"].samples[0].output_token_ids
                assert out == [runner.token_at(16 + k) for k in range(len(out))]
                if step_kind != "final":
                    assert [t for r in records for t in r["tokens"][f"d{i}"]] == out[-8:]
            assert all(t == [runner.token_at(64)] for r in records
                       for rid, t in r["tokens"].items() if rid.startswith("p"))
        else:
            assert all(r["prepare"] > 0 and r["dispatch"] > 0 and r["readback"] > 0
                       for r in records)
        stats = engine.stats()
        if kind == "model" and step_kind in ("decode", "penalized"):  # penalties run ahead too
            assert stats["lookahead_hits"] >= len(records), stats
        assert list(stats["step_phases"]) == list(bench_host.COLUMNS)
        assert 0 < sum(stats["step_phases"].values()) <= stats["step_seconds"]
        row = bench_host.summarize(records, n)
        assert row["compiles"] == 0 and row["tok_s"] == pytest.approx(n / row["step"] * 1e3)


FAKE_VLLM = '''
"""A stand-in for vllm: records how LLM() was made, and generates max_tokens tokens at
1 ms a token."""
import json, os, time
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, max_tokens=16, temperature=1.0, ignore_eos=False):
        self.max_tokens = max_tokens

class _Out:
    def __init__(self, n):
        self.outputs = [type("C", (), {"token_ids": [5] * n})()]

class LLM:
    def __init__(self, model, **kwargs):
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        tokenizer = os.path.isfile(os.path.join(model, "tokenizer.json"))
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"config": config, "tokenizer": tokenizer, **kwargs}) + "\\n")

    def generate(self, requests, params, use_tqdm=False):
        time.sleep(0.02 * params[0].max_tokens)  # 20 ms a step: well above a busy CI's jitter
        return [_Out(p.max_tokens) for p in params]
'''


def test_host_bench_main_and_vllm_plumbing(host_bench_model, tmp_path):
    """bench_host's whole run at 1 and 2 sequences on the 2-layer model, the vLLM column
    through the real scripts/vllm_peer.py and run_vllm_peer under a stand-in vllm module
    (no vLLM here): the peer gets the bench's HF model and the sizes' limits, its steps
    come back per size, the JSON holds every case, and the profile lists functions."""
    import json

    import bench_host

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "llm.jsonl"
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path} FAKE_VLLM_LOG={log} "
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    out = tmp_path / "result.json"
    results = bench_host.main(["--sizes", "1,2", "--steps", "3", "--warm", "1", "--layers", "2",
                               "--chunk", "16", "--lens", "2,4", "--rounds", "1",
                               "--vllm-python", str(python), "--profile", "2", "--top", "5",
                               "--json", str(out), "--no-freeze"])  # leave pytest's heap be
    made = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(made) == 1 and made[0]["max_num_seqs"] == 2
    assert made[0]["max_num_batched_tokens"] == 2 + 16 and made[0]["max_model_len"] == 1024
    config = made[0]["config"]
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 512
    assert made[0]["tokenizer"]
    assert sorted(results["vllm"]) == sorted(results["delta"]) == [1, 2]
    assert all(ms > 0 for ms in results["vllm"].values())  # the stand-in's 20 ms a step
    saved = json.loads(out.read_text())
    assert sorted((c["kind"], c["engine"], c["seqs"]) for c in saved["cases"]) == sorted(
        (k, e, n) for k in ("decode", "final", "mixed") for e in ("host", "model")
        for n in (1, 2))
    # a profile per engine at size 2: its top 5 functions by their own time
    profiles = {p["engine"]: p["functions"] for p in saved["profiles"] if p["seqs"] == 2}
    assert sorted(profiles) == ["host", "model"] and saved["timer_mark_ns"] > 0
    assert all(len(rows) == 5 for rows in profiles.values())
    assert all(r["calls"] > 0 and r["cum_ms"] >= r["own_ms"] >= 0
               for rows in profiles.values() for r in rows)


def test_bench_gpu_engine_plumbing(tmp_path):
    """scripts/bench_gpu_engine.py --tiny on CPU, as a GPU runs it but small: jaxpage and HF
    transformers, each in a process of its own, on the same weights (HF loads jaxpage's, split
    and transposed back) and the same trace. Every request produces its ignore_eos length in
    each of jaxpage's runs and both of HF's, HF's greedy tokens are jaxpage's (float32), the
    JSON carries each figure of the table, and no profiled window is busier than its wall."""
    import json

    out = tmp_path / "gpu_engine.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu_engine.py"), "--tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=SCRIPTS.parent, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "jaxpage/best HF" in done.stdout and "decode at 24 tokens" in done.stdout
    data = json.loads(out.read_text())
    _, lens = bench_common.sharegpt_trace(6, 0, 512, (4, 40), (3, 12))  # the --tiny trace
    assert data["trace"]["tiny"]["requests"] == 6
    assert data["trace"]["tiny"]["output_tokens"] == sum(lens)
    ours, hf = data["results"]["tiny"]["jaxpage"], data["results"]["tiny"]["hf"]
    for run in ("cold", "warm"):
        assert ours[run]["complete"] and ours[run]["lengths_ok"], ours[run]
        assert ours[run]["produced_tokens"] == lens and ours[run]["output_tokens"] == sum(lens)
    assert ours["cold"]["compiles"] > 0 and ours["warm"]["compiles"] == 0
    assert hf["weights"].startswith("jaxpage's")
    for name in ("static", "continuous"):
        assert hf[name]["complete"] and hf[name]["lengths_ok"], hf[name]
        assert hf[name]["produced_tokens"] == lens and hf[name]["output_tokens"] == sum(lens)
        same = hf[name]["agreement_with_jaxpage"]
        assert same["compared"] == 6 and same["same_first_token"] == 6
        assert same["identical"] >= 5  # one near-tie between two float32 kernels at most
    summary = data["summary"]["tiny"]
    for key in ("jaxpage_tok_s", "hf_static_tok_s", "hf_continuous_tok_s", "ratio_to_best_hf",
                "mean_step_ms", "device_ms_per_step"):
        assert summary[key] > 0 or key == "device_ms_per_step" and summary[key] == 0, key
    window = ours["warm"]["window"]
    assert window["steps"] > 0 and 0 <= window["busy_s"] <= window["wall_s"]
    assert ours["copy_gbps"] > 0
    assert [d["batch"] for d in ours["decode"]] == [1, 4]
    for d in ours["decode"]:
        assert d["wall_ms"] > 0 and d["bound_ms"] > 0 and d["forward_alone_ms"] > 0
        assert d["weight_bytes"] > 0 and d["kv_bytes"] == pytest.approx(
            # layers, K and V, heads, head dim, float32; the prompt, the first token, two
            # warm-up steps, then the mean of 8 timed steps
            d["batch"] * 2 * 2 * 2 * 16 * 4 * (24 + 1 + 2 + 3.5))
        assert 0 <= d["window"]["busy_s"] <= d["window"]["wall_s"]


def test_lora_bench_core(tmp_path):
    """bench_lora's adapters load and serve, each request its output length, and its FLOP
    accounting is a hand count: SmolLM2-shaped 576 / 960 / 1536 widths at rank 16."""
    import bench_lora

    from jaxpage import LLM, LoRARequest
    from jaxpage.models.config import ModelConfig

    path = bench_common.write_hf_llama(str(tmp_path / "model"), num_hidden_layers=2)
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64)
    config = llm.engine.model.config
    paths = bench_lora.write_adapters(str(tmp_path / "adapters"), config, 3, 8)
    requests = [LoRARequest(f"x{i}", i + 1, p) for i, p in enumerate(paths)]
    prompts, lens = bench_common.make_trace(5, 0, config.vocab_size)
    lens = [min(n, 6) for n in lens]
    loras = bench_lora.assignments(requests, 3, len(prompts))
    assert [r.lora_name for r in loras] == ["x0", "x1", "x2", "x0", "x1"]
    assert bench_lora.run_trace(llm, prompts, lens, loras) > 0
    assert len(llm.list_loras()) == 3
    smollm = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, max_position_embeddings=2048)
    per_layer = 2 * (576 * 48 + 48 * 960 + 576 * 16 + 16 * 576 + 576 * 32 + 32 * 3072
                     + 1536 * 16 + 16 * 576)
    assert bench_lora.lora_flops_per_token(smollm, 16) == 30 * per_layer
