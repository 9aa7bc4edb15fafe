"""What handing a step's arrays to a jitted function costs the host, by how many there are.

Lab probe of stacking the params and KV pools per kind (docs/cpu_decode_history.md). A CPU
runner's step function takes the params (SmolLM2-135M packed: 182 arrays) and the KV pool
(a K and a V array per layer, 60, donated), and the host's CPU time to dispatch it grows with
their count: JAX checks and flattens each argument, and PJRT holds each buffer and adds its use
events, the donated ones replaced by new arrays. Here a jitted function that reads one element
of each array (so none is pruned) over arrays of the runner's shapes (the pool with few blocks:
the bytes do not matter, the count does) is dispatched as the runner's layout has it, with the
params stacked per kind (4 packed weights [L, ...], the norms [L, 2, H], the head and final
norm: 8 arrays), and with the pool stacked too (a K and a V array [L, ...]: 2). Each is timed
(the dispatching thread's CPU time, the median of 30) in a loop that keeps the caches warm,
and after a 300 MB sweep before each call, as a decode step leaves the caches (it streams the
weights): the host runs the next step's dispatch while the last step runs.

    python scripts/lab/bench_dispatch.py
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import HIDDEN, LAYERS  # noqa: E402

# packed shapes of SmolLM2-135M's projections in bfloat16 ([panels, K / 2, 32, 2])
PACKED = {"qkv": (30, 288, 32, 2), "o": (18, 288, 32, 2), "gate_up": (96, 288, 32, 2),
          "down": (18, 768, 32, 2)}
POOL = (3, 64, 16, 64)  # [KV heads, blocks, block size, head dim]


def dispatch_seconds(params, pool, extras, sweep) -> tuple[float, object]:
    """Median host CPU seconds of dispatching one call (after one that compiles), with a read
    of `sweep` before each call when it is given; returns the pool it ends with (donated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, pool, extras):
        read = sum(jnp.sum(x[(0,) * x.ndim].astype(jnp.float32))
                   for x in jax.tree.leaves((params, extras)))
        return read, pool

    out, pool = step(params, pool, extras)
    out.block_until_ready()
    times = []
    for _ in range(30):
        if sweep is not None:
            sweep.sum()
        start = time.thread_time()
        out, pool = step(params, pool, extras)
        times.append(time.thread_time() - start)
        out.block_until_ready()
    return float(np.median(times)), pool


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]

    def zeros(shape):
        return jnp.zeros(shape, jnp.bfloat16)

    layers = [{"attn_norm": zeros(HIDDEN), "mlp_norm": zeros(HIDDEN),
               **{kind: zeros(shape) for kind, shape in PACKED.items()}}
              for _ in range(LAYERS)]
    head = {"embed": zeros(PACKED["o"]), "norm": zeros(HIDDEN)}
    layouts = {
        "per layer": ({**head, "layers": layers},
                      [zeros(POOL) for _ in range(2 * LAYERS)]),
        "params stacked": ({**head, "norms": zeros((LAYERS, 2, HIDDEN)),
                            **{kind: zeros((LAYERS, *shape)) for kind, shape in PACKED.items()}},
                           [zeros(POOL) for _ in range(2 * LAYERS)]),
        "params and pool stacked": ({**head, "norms": zeros((LAYERS, 2, HIDDEN)),
                                     **{kind: zeros((LAYERS, *shape))
                                        for kind, shape in PACKED.items()}},
                                    [zeros((LAYERS, *POOL)) for _ in range(2)]),
    }
    # the step's metadata, on the device as a run-ahead step's token ids are
    extras = jax.device_put([np.zeros(8, np.int32)] * 5 + [np.zeros((8, 16), np.int32),
                                                          np.zeros(9, np.int32)], device)
    sweep = np.ones(300 * 2**20 // 8)
    print(f"{'layout':<26}{'arrays':>8}{'warm ms':>9}{'swept ms':>10}{'x per layer':>13}")
    base = None
    for name, (params, pool) in layouts.items():
        params, pool = jax.device_put((params, pool), device)
        count = len(jax.tree.leaves(params)) + len(pool)
        warm, pool = dispatch_seconds(params, pool, extras, None)
        swept, pool = dispatch_seconds(params, pool, extras, sweep)
        base = base or swept
        print(f"{name:<26}{count:>8}{warm * 1e3:>9.3f}{swept * 1e3:>10.3f}"
              f"{base / swept:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
