"""The int8 packed matmul against the bfloat16 one on SmolLM2-135M's projections, A/B.

Lab probe of weight-only int8 on CPU (issue #65, docs/kernels.md "int8 weights"): each of
SmolLM2-135M's projection shapes ([576, 960] qkv, [576, 576] o, [576, 3072] gate_up, [1536,
576] down) and all four in turn, at each row count, as `packed_matmul_int8` of bfloat16 x over
int8 panels with per-column scales and as `packed_matmul` of bfloat16 x over bfloat16 panels,
the two alternating call by call (60 each, medians), beside the GB/s each streams its weights
at, the int8/bfloat16 time ratio, and the floor each read sets at the machine's read bandwidth
(`bench_common.read_gbps`): int8's is half of bfloat16's, so a few-row call bound by its weights
runs near 0.5x. Several weights' copies are cycled (`--copies`) so that a call reads its panels
from memory, not from a cache the previous call left them in.

    python scripts/lab/int8_matmul_ab.py --rows 1,2,4,8,64
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import alternating_seconds, read_gbps  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,64")
    ap.add_argument("--copies", type=int, default=30,
                    help="copies of each weight cycled through (more than the caches hold)")
    ap.add_argument("--runs", type=int, default=60)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the CPU kernel library is not available")
    rng = np.random.default_rng(0)
    weights = {}  # name: ([int8 packed], [scale], [bfloat16 packed]) over the copies
    for name, (k, n) in SHAPES.items():
        ints = [rng.integers(-128, 128, (k, n), dtype=np.int8) for _ in range(args.copies)]
        scales = [jnp.asarray(rng.uniform(1e-3, 2e-2, n), jnp.float32) for _ in ints]
        weights[name] = ([jnp.asarray(cpu_ops.pack_weight_int8(w)) for w in ints], scales,
                         [cpu_ops.pack_weight(jnp.asarray(w, jnp.bfloat16)) for w in ints])

    int8_step = jax.jit(cpu_ops.packed_matmul_int8)
    bf16_step = jax.jit(cpu_ops.packed_matmul)

    def cycle(names, int8):
        state = {"i": 0}

        def run(xs):
            i = state["i"] = (state["i"] + 1) % args.copies
            outs = []
            for name in names:
                packed, scales, packed_bf16 = weights[name]
                x = xs[SHAPES[name][0]]
                outs.append(int8_step(x, packed[i], scales[i]) if int8
                            else bf16_step(x, packed_bf16[i]))
            return outs
        return run

    bandwidth = read_gbps()
    print(f"read bandwidth {bandwidth:.1f} GB/s; int8's floor is half of bfloat16's")
    print(f"{'rows':>5}  {'weights':<10}{'int8 ms':>9}{'GB/s':>7}{'bf16 ms':>9}{'GB/s':>7}"
          f"{'int8/bf16':>11}{'floor i8':>10}{'floor bf':>10}")
    cases = [(name, [name]) for name in SHAPES] + [("all four", list(SHAPES))]
    for rows in [int(r) for r in args.rows.split(",") if r]:
        xs = {k: jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
              for k in {k for k, _ in SHAPES.values()}}
        for label, names in cases:
            int8_s, bf16_s = alternating_seconds([cycle(names, True), cycle(names, False)], xs,
                                                 runs=args.runs)
            elements = sum(k * n for k, n in (SHAPES[name] for name in names))
            print(f"{rows:>5}  {label:<10}{int8_s * 1e3:>9.3f}{elements / int8_s / 1e9:>7.1f}"
                  f"{bf16_s * 1e3:>9.3f}{2 * elements / bf16_s / 1e9:>7.1f}"
                  f"{int8_s / bf16_s:>10.2f}x{elements / bandwidth / 1e6:>10.3f}"
                  f"{2 * elements / bandwidth / 1e6:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
