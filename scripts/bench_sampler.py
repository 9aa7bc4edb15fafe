"""The sampler's greedy rows on CPU: the kernel library's one-pass draw against XLA's jnp.

For each number of rows (a decode step's logits over SmolLM2's 49,152-token vocabulary), the
same random logits through `cpu_ops.greedy_draw` (what `sampling.sample` takes for greedy
rows without top logprobs on CPU) and through `sampling.greedy_xla` (the jnp it replaces: a max,
a select-and-min over indices, a log-sum-exp), each jitted, the two alternating call by call
(medians of 50), beside the bound of reading the logits once at this machine's read bandwidth
(`bench_common.read_gbps`: a C loop, a thread a core). The tokens must agree.

    python scripts/bench_sampler.py [--rows 1,8,64] [--vocab 49152]
"""

from __future__ import annotations

import argparse
import time

from bench_common import VOCAB, read_gbps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()

    import jax
    import numpy as np

    from jaxpage import sampling
    from pallas_kernels import cpu_ops

    if not cpu_ops.available():
        print("the CPU kernel library is not available: nothing to compare")
        return
    bandwidth = read_gbps()
    print(f"read bandwidth {bandwidth:.1f} GB/s; vocabulary {args.vocab}")
    print(f"{'rows':>5}{'MB':>7}{'bound ms':>10}{'kernel ms':>11}{'XLA ms':>9}{'speedup':>9}"
          f"{'x bound':>9}")
    kernel, xla = jax.jit(cpu_ops.greedy_draw), jax.jit(sampling.greedy_xla)
    rng = np.random.default_rng(0)
    for rows in (int(r) for r in args.rows.split(",")):
        logits = jax.device_put((rng.standard_normal((rows, args.vocab)) * 4).astype(np.float32))
        ours, theirs = kernel(logits), xla(logits)
        if not np.array_equal(np.asarray(ours[0]), np.asarray(theirs[0])):
            raise AssertionError(f"{rows} rows: the kernel's tokens differ from XLA's")
        times = ([], [])
        for _ in range(args.calls):
            for fn, out in zip((kernel, xla), times, strict=True):
                start = time.perf_counter()
                jax.block_until_ready(fn(logits))
                out.append(time.perf_counter() - start)
        mine, other = (float(np.median(t)) * 1e3 for t in times)
        megabytes = logits.nbytes / 1e6
        bound = megabytes / (bandwidth * 1e3) * 1e3
        print(f"{rows:>5}{megabytes:>7.1f}{bound:>10.3f}{mine:>11.3f}{other:>9.3f}"
              f"{other / mine:>8.1f}x{mine / bound:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
