"""Cost of one decode step against its batch size: why more concurrent sequences pay less on
a CPU than on a GPU.

The default model (SmolLM2-135M, float32) runs one decode step (every sequence at the same
context, greedy sampling included) at each batch size, in one process, after measuring the
machine's float32 matmul rate. Prints milliseconds per step and per sequence, the step's
FLOP rate and its share of the matmul rate. (The engine pads decode batches below 8 rows to
8, so 8 is where the list starts.) A batch of 1 reads every weight once per token;
as long as the step is bound by reading the weights, more rows are nearly free (the regime
of the vLLM paper's GPUs); once it is bound by arithmetic, each row adds its own cost.

    python scripts/bench_decode_step.py                      # context 128
    python scripts/bench_decode_step.py --context 256 --batches 8,64
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import decode_step_rate, make_llm, matmul_gflops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batches", default="8,12,16,24,32,48,64")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    rate = matmul_gflops()
    llm = make_llm(max(batches))
    print(f"matmul rate (2048^3 f32): {rate:.1f} GFLOP/s; context {args.context}; decode "
          f"buckets {llm.engine.runner.decode_buckets}")
    print(f"{'batch':>6}{'ms/step':>10}{'ms/seq':>9}{'GFLOP/s':>10}{'of matmul':>11}")
    for batch in batches:
        seconds, flops = decode_step_rate(llm, batch, args.context)
        print(f"{batch:>6}{seconds * 1e3:>10.1f}{seconds * 1e3 / batch:>9.2f}"
              f"{flops / seconds / 1e9:>10.1f}{flops / seconds / 1e9 / rate:>11.0%}", flush=True)


if __name__ == "__main__":
    main()
