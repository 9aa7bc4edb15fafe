"""The packed matmul kernel's chains at its own prefetch distance against a fixed one, A/B.

Lab probe of the packed kernels' prefetch distance (docs/cpu_decode_history.md): the packed
chains of scripts/bench_small_matmul.py (SmolLM2-135M's projections and head at a given row
count, one kind at a time, all together and all in turn) run with the panels prefetched at
the kernel's own distance for the rows and `--bytes` ahead (`packed_matmul(prefetch_bytes=)`),
the two alternating run by run (60 each, medians), beside the GB/s each streams the weights
at and the read bandwidth (`bench_common.read_gbps`), which bounds both.

    python scripts/lab/matmul_prefetch_ab.py --rows 1,2,4,8 --bytes 4096
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import INTERMEDIATE, alternating_seconds, read_gbps  # noqa: E402
from bench_small_matmul import chain, chain_bytes, chain_cases, kernel, model_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--bytes", type=int, default=4096,
                    help="the fixed prefetch distance in a panel, bytes")
    args = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the CPU kernel library is not available")
    bandwidth = read_gbps()
    print(f"read bandwidth {bandwidth:.1f} GB/s")
    print(f"{'dtype':>9}{'rows':>5}  {'chain':<24}{'own ms':>8}{'GB/s':>7}"
          f"{'pf ' + str(args.bytes):>9}{'GB/s':>7}{'pf/own':>8}")
    fixed = functools.partial(kernel, prefetch_bytes=args.bytes)
    rng = np.random.default_rng(0)
    for dtype in [jnp.dtype(d) for d in args.dtypes.split(",") if d]:
        layers, head, packed, packed_head = model_weights(rng, dtype)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = jnp.asarray(rng.standard_normal((rows, INTERMEDIATE), np.float32), dtype)
            for name, kinds, with_head, in_turn in chain_cases():
                own, other = alternating_seconds(
                    [chain(kinds, with_head, rows, dtype, kernel, in_turn),
                     chain(kinds, with_head, rows, dtype, fixed, in_turn)],
                    x, packed, packed_head)
                nbytes = chain_bytes(packed, packed_head, kinds, with_head)
                print(f"{dtype.name:>9}{rows:>5}  {name:<24}{own * 1e3:>8.2f}"
                      f"{nbytes / own / 1e9:>7.1f}{other * 1e3:>9.2f}{nbytes / other / 1e9:>7.1f}"
                      f"{other / own:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
