"""The multi-LoRA kernel (`cpu_ops.lora_matmul`) against the jnp reference and the base matmul.

Lab probe of the CPU kernel for multi-LoRA serving (cpu/lora.h): at SmolLM2-135M's projection
shapes (hidden 576: qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576), S =
17 adapter slots of rank R, bfloat16, each of T rows given a random adapter in 1..16, it times

- `base`: the projection itself, `jnp.dot(x, W, preferred_element_type=float32)`;
- `kernel`: `cpu_ops.lora_matmul(y, x, a, b, slots)` on the base's float32 output y, y donated
  (updated in place, as in a model where y is the matmul's fresh output);
- `ref`: `pallas_kernels.lora.lora_matmul_reference` (per-row gathers of A and B, einsums), the
  form XLA runs where there is no kernel;
- `base+kernel` and `base+ref`: the projection and its delta in one jitted function,

each the median of `--runs` calls after a warm-up, run in turn. `k/base` and `ref/base`: the
delta's cost as a multiple of the base projection's.

    python scripts/lab/lora_kernel_ab.py --rows 1,8,64,512 --runs 20
"""

from __future__ import annotations

import argparse
import time

# (name, K, N, R): the four projections at rank 16, and qkv at rank 48 as well
CASES = [("qkv", 576, 960, 16), ("qkv", 576, 960, 48), ("o", 576, 576, 16),
         ("gate_up", 576, 3072, 16), ("down", 1536, 576, 16)]
NUM_SLOTS = 17


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops, lora

    if not cpu_ops.available():
        raise SystemExit("the CPU kernel library is not available")
    dtype = jnp.dtype(args.dtype)
    f32 = jnp.float32

    def base(x, w):
        return jnp.dot(x, w, preferred_element_type=f32)

    def with_kernel(x, w, a, b, slots):
        return cpu_ops.lora_matmul(base(x, w), x, a, b, slots)

    def with_ref(x, w, a, b, slots):
        return lora.lora_matmul_reference(base(x, w), x, a, b, slots)

    jit_base, jit_ref = jax.jit(base), jax.jit(lora.lora_matmul_reference)
    jit_kernel = jax.jit(cpu_ops.lora_matmul, donate_argnums=0)
    jit_with_kernel, jit_with_ref = jax.jit(with_kernel), jax.jit(with_ref)

    def time_case(x, w, a, b, slots) -> dict[str, float]:
        """Median ms of each form, run in turn (`--runs` times after a warm-up)."""
        y = jax.block_until_ready(jit_base(x, w))
        fresh = jax.jit(lambda y: y + 0)  # a copy of y for each kernel call (it donates y)
        timed = {  # each: (its arguments, made untimed; the timed function)
            "base": (lambda: (x, w), jit_base),
            "kernel": (lambda: (fresh(y), x, a, b, slots), jit_kernel),
            "ref": (lambda: (y, x, a, b, slots), jit_ref),
            "base+kernel": (lambda: (x, w, a, b, slots), jit_with_kernel),
            "base+ref": (lambda: (x, w, a, b, slots), jit_with_ref),
        }
        times = {key: [] for key in timed}
        for _ in range(args.runs + 1):  # the first, a warm-up
            for key, (make, fn) in timed.items():
                call_args = jax.block_until_ready(make())
                start = time.perf_counter()
                jax.block_until_ready(fn(*call_args))
                times[key].append(time.perf_counter() - start)
        return {key: float(np.median(v[1:])) * 1e3 for key, v in times.items()}

    print(f"{jax.devices()[0].device_kind}, {args.dtype}, S = {NUM_SLOTS}, medians of "
          f"{args.runs} runs (ms)")
    print(f"{'proj':<8}{'K':>5}{'N':>5}{'R':>4}{'T':>5}{'base':>9}{'kernel':>9}{'ref':>9}"
          f"{'base+kernel':>13}{'base+ref':>10}{'k/base':>8}{'ref/base':>9}")
    rng = np.random.default_rng(0)
    for name, k, n, r in CASES:
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
        a = jnp.asarray(rng.standard_normal((NUM_SLOTS, k, r)) / np.sqrt(k), dtype)
        b = jnp.asarray(rng.standard_normal((NUM_SLOTS, r, n)) / np.sqrt(r), dtype)
        for t in [int(v) for v in args.rows.split(",") if v]:
            x = jnp.asarray(rng.standard_normal((t, k)), dtype)
            slots = jnp.asarray(rng.integers(1, NUM_SLOTS, t), jnp.int32)
            ms = time_case(x, w, a, b, slots)
            print(f"{name:<8}{k:>5}{n:>5}{r:>4}{t:>5}{ms['base']:>9.3f}{ms['kernel']:>9.3f}"
                  f"{ms['ref']:>9.3f}{ms['base+kernel']:>13.3f}{ms['base+ref']:>10.3f}"
                  f"{ms['kernel'] / ms['base']:>8.2f}{ms['ref'] / ms['base']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
