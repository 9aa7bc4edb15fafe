"""Lab probe: a variant of the CPU kernel library against its build, A/B in one process.

An environment variable that a scratch build of the library reads at each call is set and
unset round by round while the runner (or the engine) decodes. On a shared machine whose read
bandwidth drifts 25-50 GB/s within an hour, two processes (one per build) compare the hours they
ran in as much as the builds; here both variants share every round's conditions, and the paired
differences' median says which is faster and by how much.
The variant: a copy of the `pallas_kernels/cpu/` directory whose change is taken only while
`getenv("NAME")` is set (`#include <cstdlib>`), built as the library builds itself
(`--source DIR`: cpu_library's flags, cached by the directory's contents) or given prebuilt in
JAXPAGE_CPU_KERNEL_LIB. E.g. for the packed matmuls' units (2026-12-04), in the copy's
matmul_packed.h:

    work.units = std::min(P, threads * (rows <= kPackedRows && !getenv("FOUR_UNITS")
                                        ? 1 : kPackedUnitsPerThread));

    cp -r pallas_kernels/cpu /tmp/variant   # then edit /tmp/variant/matmul_packed.h
    python scripts/lab/ab_env_switch.py FOUR_UNITS --source /tmp/variant --batch 8
    python scripts/lab/ab_env_switch.py FOUR_UNITS --source /tmp/variant --engine

The runner's rounds time 4 decode steps of `--batch` sequences of context 128 (bfloat16, the
default model) after one untimed; the engine's (`--engine`) the median step while `--batch`
requests decode 24 tokens each (run ahead, scheduling and detokenizing included);
`--attention`'s the paged attention kernel alone, 30 layers of a decode step of `--batch`
sequences of 129 tokens over scattered blocks (bench_attention.py's pools and step), where a
change to the kernel shows without the rest of the step's noise around it.

`--by-placement SECONDS` runs rounds for that long instead and reports them by where the two
threads ran (bench_common's `round_trip_ns` probe before and after each round: `near`, one CCX,
and `far`, two CCDs; a round whose two disagree is dropped): on a 2-core VM whose vCPUs move
between placements, a change to the handoffs between the threads can win in one and lose in the
other.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/

from bench_common import NEAR_NS, decode_seqs, decode_step_seconds, make_llm, probes  # noqa: E402


def attention_ms(batch: int, dtype: str):
    """A function timing 30 layers of the attention kernel on a decode step of `batch`
    sequences of 129 tokens (each layer its own pools, blocks scattered), in ms."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_attention import all_layers, make_pools, make_step

    from pallas_kernels import cpu_ops

    pools = make_pools(jnp.dtype(dtype))
    step = make_step(np.random.default_rng(0), [129] * batch, [1] * batch, jnp.dtype(dtype))[:4]
    layers = jax.jit(functools.partial(all_layers, cpu_ops.paged_attention_cpu))

    def ms() -> float:
        start = time.perf_counter()
        jax.block_until_ready(layers(step[0], *pools, *step[1:]))
        return (time.perf_counter() - start) * 1e3

    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", help="the environment variable the scratch build reads")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=0,
                    help="default: 40 (runner, attention), 16 (engine)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--engine", action="store_true", help="the engine's steps, not the runner's")
    mode.add_argument("--attention", action="store_true",
                      help="the attention kernel alone (30 layers of a decode step)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--by-placement", type=float, default=0, metavar="SECONDS",
                    help="rounds for SECONDS, reported by where the two threads ran")
    ap.add_argument("--source", help="the variant: a directory holding a copy of "
                                     "pallas_kernels/cpu/, built here (else the library "
                                     "JAXPAGE_CPU_KERNEL_LIB names)")
    args = ap.parse_args()
    if args.source:
        from pathlib import Path

        from pallas_kernels import cpu_library

        os.environ["JAXPAGE_CPU_KERNEL_LIB"] = str(cpu_library._build(Path(args.source)))

    import numpy as np

    if args.attention:
        measure, what = attention_ms(args.batch, args.dtype), "attention (30 layers)"
        rounds = args.rounds or 40
    else:
        llm = make_llm(max(args.batch, 8), dtype=args.dtype)
        engine, runner = llm.engine, llm.engine.runner
        rng = np.random.default_rng(0)
        seqs = decode_seqs(runner, args.batch, 128)

        def runner_ms() -> float:
            runner.execute(seqs)
            start = time.perf_counter()
            for _ in range(4):
                runner.execute(seqs)
            return (time.perf_counter() - start) / 4 * 1e3

        def engine_ms() -> float:
            return float(np.median(decode_step_seconds(engine, f"ab-{rng.integers(1 << 30)}",
                                                       args.batch, 128, 24, rng))) * 1e3

        measure = engine_ms if args.engine else runner_ms
        what = "engine step" if args.engine else "runner step"
        rounds = args.rounds or (16 if args.engine else 40)
    measure()  # compiles

    def paired_round(r: int) -> tuple[float, float]:
        """(unset, set) ms, which goes first alternating with r."""
        times = {}
        for on in (r % 2 == 0, r % 2 == 1):
            if on:
                os.environ[args.name] = "1"
            else:
                os.environ.pop(args.name, None)
            times[on] = measure()
        os.environ.pop(args.name, None)
        return times[False], times[True]

    groups: dict[str, list] = {"": []}
    if args.by_placement:
        lib = probes()
        if lib is None:
            raise SystemExit("--by-placement needs bench_common's C probes")
        groups = {"near": [], "far": []}
        end, r = time.perf_counter() + args.by_placement, 0
        while time.perf_counter() < end:
            before = lib.round_trip_ns(3000)
            pair = paired_round(r)
            after = lib.round_trip_ns(3000)
            r += 1
            if (before < NEAR_NS) == (after < NEAR_NS):
                groups["near" if before < NEAR_NS else "far"].append(pair)
    else:
        groups[""] = [paired_round(r) for r in range(rounds)]
    for where, pairs in groups.items():
        if not pairs:
            continue
        off, on = np.array(pairs).T
        diff = on - off
        print(f"{what}, {args.batch} rows, {args.dtype}{', ' + where if where else ''}: "
              f"{args.name} unset {np.median(off):.2f} ms, set {np.median(on):.2f} ms; paired "
              f"difference median {np.median(diff):+.2f} ms, set faster in "
              f"{np.mean(diff < 0):.0%} of {len(pairs)} rounds")


if __name__ == "__main__":
    main()
