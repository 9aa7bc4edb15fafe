"""The runner's share of a decode step, call by call: at N decoding sequences of bench_host's
near-zero model (30 Llama layers, one 64-wide head, vocabulary 512), the median host time of
each jitted call by kind (the forward, the sampler, a run-ahead step's token ids and inputs)
and of the runner's methods that build and start a step (`_dispatch`: packed on the host;
`_advance`: made on the device from the step before; `_run_ahead`: the whole run-ahead step).

A tree against another: run it in each (`PYTHONPATH=<tree> python <tree>/scripts/lab/...`), in
turn; the medians of one run swing with the machine's load, so compare runs made in turn.

    python scripts/lab/runner_calls.py --seqs 64,256
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

METHODS = ("_dispatch", "_advance", "_run_ahead", "_results")


def timed_calls(num_seqs: int, steps: int, hf_dir: str) -> dict[str, list[float]]:
    """Seconds of each jitted call (by its shape key's kind) and of each of METHODS, over
    `steps` decode steps of `num_seqs` sequences once the engine is warm."""
    import bench_host

    model, params, tokenizer = bench_host.load(hf_dir)
    _, engine = bench_host.run_case("model", "final", model, params, tokenizer, num_seqs,
                                    chunk=64, warm=8, steps=8, freeze=True)
    runner = engine.runner
    seconds: dict[str, list[float]] = collections.defaultdict(list)

    def timing(name: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[name].append(time.perf_counter() - start)
            return out
        return run

    call = runner._call
    runner._call = lambda key, *a, **k: timing(
        key[0] if isinstance(key[0], str) and key[0] != "forward" else "forward",
        call)(key, *a, **k)
    for name in METHODS:
        if hasattr(runner, name):
            setattr(runner, name, timing(name, getattr(runner, name)))
    bench_host.phase_steps(engine, steps)
    return seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="64,256", help="decoding sequences, comma-separated")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps")
    args = ap.parse_args(argv)
    from bench_common import write_hf_llama

    hf_dir = write_hf_llama(tempfile.mkdtemp(), num_hidden_layers=30)
    for num_seqs in (int(n) for n in args.seqs.split(",")):
        seconds = timed_calls(num_seqs, args.steps, hf_dir)
        print(f"\n{num_seqs} sequences, {args.steps} decode steps: median ms a call (calls)")
        for name, values in sorted(seconds.items()):
            print(f"  {name:12s} {np.median(values) * 1e3:8.3f}  ({len(values)})")


if __name__ == "__main__":
    main()
