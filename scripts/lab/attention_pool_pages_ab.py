"""The CPU attention kernel over pools of 4 KiB pages against pools backed by huge pages, A/B.

Lab probe of the KV pool's huge pages (docs/cpu_decode_history.md): each decode and prefill
case of scripts/bench_attention.py (a SmolLM2-shaped step over 30 layers' pools, permuted block
tables) runs the C++ kernel on the pools as XLA allocated them (4 KiB pages: each block of a
permuted table a page and a TLB miss of its own) and on a second copy backed by huge pages
(`huge_pages.advise`, as a CPU runner's pool is), the two alternating (15 each, medians). It
prints both times, the 4 KiB pools' over the huge ones', and the rate each reads the step's
K/V at (the bytes the step cannot avoid reading).

    python scripts/lab/attention_pool_pages_ab.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_attention import all_layers, cases, make_pools, make_step  # noqa: E402
from bench_common import alternating_seconds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="the pools' and queries' dtype")
    ap.add_argument("--runs", type=int, default=15, help="alternating runs of each")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpage.engine import huge_pages
    from pallas_kernels import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the CPU kernel library is not available")
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    small_pools = make_pools(dtype)
    huge_pools = make_pools(dtype)
    if not huge_pages.advise(jax.tree.leaves(huge_pools)):
        raise SystemExit("Linux backed none of the pools with huge pages here")
    print(f"{'case':<34}{'KV MB':>7}{'4K ms':>8}{'GB/s':>7}{'huge ms':>9}{'GB/s':>7}"
          f"{'4K/huge':>9}")
    fn = jax.jit(functools.partial(all_layers, cpu_ops.paged_attention_cpu))
    for name, lens, new, _ in cases(rng):
        q, tables, seq_lens, qsl, kv_bytes = make_step(rng, lens, new, dtype)
        small, huge = alternating_seconds(
            [functools.partial(fn, q, *pools) for pools in (small_pools, huge_pools)],
            tables, seq_lens, qsl, runs=args.runs)
        print(f"{name:<34}{kv_bytes / 1e6:>7.0f}{small * 1e3:>8.1f}{kv_bytes / small / 1e9:>7.1f}"
              f"{huge * 1e3:>9.1f}{kv_bytes / huge / 1e9:>7.1f}{small / huge:>8.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
