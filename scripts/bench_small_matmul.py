"""The kernel library's few-row matmuls on a decode step's weights, against the read bandwidth.

The few-row kernel (`cpu_ops.small_matmul`) and the packed one on SmolLM2-135M's weights, in
one process.

A decode step of few rows is a stream of the weights: each projection and the LM head reads
every weight once. This runs SmolLM2-135M's shapes (30 layers of qkv [576, 960], o
[576, 576], gate_up [576, 3072], down [1536, 576], each layer its own random weights, and the
tied head [49152, 576] read as [N, K]) at a given row count, jitted as chains of one kind
(30 calls), all together (121) and all in turn (121, each call's x the one before's output,
as in a step), and prints each chain's milliseconds, the GB/s it streams
the weights at and its share of the read bandwidth (`bench_common.read_gbps`: a C loop
streaming memory on one thread per core); the packed chains also their FLOP rate's share of the
cores' FMA peak (`bench_common.matmul_peak_gflops`), the other bound a few-row matmul
meets. The weights total 256 MiB in bfloat16, 513 MiB in float32, far beyond the caches, as in
a real step. The chains' calls are independent of one another (XLA may run two at once); a real
step's are not (the chain "in turn" is as dependent as a step; `bench_decode_step.py --profile`
times them in a step).

    python scripts/bench_small_matmul.py                    # 8 rows, bfloat16 and float32
    python scripts/bench_small_matmul.py --rows 1,8,16 --dtypes bfloat16
    python scripts/bench_small_matmul.py --rows 16,24,32,48,64 --vs-xla   # where the kernel pays
    python scripts/bench_small_matmul.py --rows 1,8 --dtypes bfloat16 --cached   # arithmetic

Each chain also runs on the same weights packed into 32-column panels
(`cpu_ops.pack_weight` / `packed_matmul`; the head packed as [H, V]: how a CPU runner
keeps them), with its speedup over the unpacked walk. The weights are backed by huge pages
where Linux can, as a CPU runner's are (`jaxpage.engine.huge_pages`). With --vs-xla each
chain also runs XLA:CPU's dot (`jnp.dot` / einsum with a float32 result, what the model runs
above `jaxpage.layers.SMALL_MATMUL_ROWS` on unpacked weights) and prints the kernel's
speedup over it. With --cached each row count also runs the packed kernel on one weight held in
the caches (o in L2, gate_up in L3), called in turn: the rate its arithmetic allows, beside
the read bandwidth (at 8 bfloat16 rows on a 2-core AMD EPYC (Zen 4) the two are alike, so a
step's matmuls from memory take more than either unless the two overlap perfectly). The packed
chains at another prefetch distance are scripts/lab/matmul_prefetch_ab.py.
"""

from __future__ import annotations

import argparse

from bench_common import (
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    QKV,
    VOCAB,
    fma_peak_gflops,
    matmul_peak_gflops,
    median_seconds,
    read_gbps,
)

# the projections as [K, N]
KINDS = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTERMEDIATE),
         "down": (INTERMEDIATE, HIDDEN)}
CHAIN_STEPS = LAYERS * len(KINDS) + 1  # a step's matmuls: every layer's and the head


def model_weights(rng, dtype) -> tuple:
    """(layers, head, packed layers, packed head): every layer's projections and the tied head
    at random in `dtype`, as [K, N] (the head [V, H]) and packed (`cpu_ops.pack_weight`, the
    head as [H, V], as `llama.pack_params` packs it), backed by huge pages where Linux can."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpage.engine import huge_pages
    from pallas_kernels import cpu_ops

    def weights(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)

    layers = [{kind: weights(*shape) for kind, shape in KINDS.items()} for _ in range(LAYERS)]
    head = weights(VOCAB, HIDDEN)
    packed = [{kind: cpu_ops.pack_weight(w) for kind, w in layer.items()} for layer in layers]
    packed_head = cpu_ops.pack_weight(head.T)
    collapsed = huge_pages.advise(jax.tree.leaves((layers, head, packed, packed_head)))
    print(f"{jnp.dtype(dtype).name}: {collapsed >> 20} MiB of weights collapsed into huge pages")
    return layers, head, packed, packed_head


def kernel(x, w, transpose_w=False, prefetch_bytes=0):
    """The kernel library's matmul of `x` by `w`: packed panels (a head packed as [H, V]: no
    transposing) or the few-row kernel on [K, N] (or [N, K] with `transpose_w`)."""
    from pallas_kernels import cpu_ops

    if w.ndim == 4:
        return cpu_ops.packed_matmul(x, w, prefetch_bytes=prefetch_bytes)
    return cpu_ops.small_matmul(x, w, transpose_w=transpose_w)


def xla(x, w, transpose_w=False):
    """XLA:CPU's dot of `x` by `w`, a float32 result."""
    import jax.numpy as jnp

    return jnp.einsum("mk,nk->mn" if transpose_w else "mk,kn->mn", x, w,
                      preferred_element_type=jnp.float32)


def chain(kinds, with_head: bool, rows: int, dtype, matmul=kernel, in_turn: bool = False):
    """A jitted function of (x, layer weights, head weight) calling `matmul` on every layer's
    weights of `kinds` and, `with_head`, on the head; each call's x its own slice of the
    input, or `in_turn` the call before's output (as in a step). Every call's result is kept
    live in a sum."""
    import jax
    import jax.numpy as jnp

    def run(inputs, layer_weights, head_weight):
        total = jnp.zeros((rows,), jnp.float32)
        h = inputs
        for layer in layer_weights:
            for kind in kinds:
                out = matmul(h[:, : KINDS[kind][0]], layer[kind])
                total += out[:, 0]
                if in_turn:  # the next call's x: this one's output (N >= its K)
                    h = out.astype(dtype)
        if with_head:
            total += matmul(h[:, :HIDDEN], head_weight, transpose_w=True)[:, 0]
        return total

    return jax.jit(run)


def chain_cases() -> list[tuple[str, list[str], bool, bool]]:
    """(name, kinds, with the head, in turn) of every chain the table times."""
    cases = [(f"{kind} x{LAYERS}", [kind], False, False) for kind in KINDS]
    return cases + [(f"head {VOCAB}x{HIDDEN}", [], True, False),
                    (f"all {CHAIN_STEPS} (a step's)", list(KINDS), True, False),
                    (f"all {CHAIN_STEPS} in turn", list(KINDS), True, True)]


def chain_bytes(layers, head, kinds, with_head: bool) -> int:
    """The weight bytes a chain reads once."""
    nbytes = sum(layer[kind].nbytes for layer in layers for kind in kinds)
    return nbytes + (head.nbytes if with_head else 0)


CACHED_KINDS, CACHED_CALLS = ("o", "gate_up"), 100


def cached_line(kind: str, packed_w, x, rows: int, dtype, dtype_peak: float,
                bandwidth: float) -> str:
    """The packed kernel on one weight (layer 0's `kind`: o's 0.6 MiB in bfloat16 stays in L2,
    gate_up's 3.4 MiB in L3) `CACHED_CALLS` times in turn (each call's x the one before's
    output): the rate its arithmetic allows at `rows` rows when memory is not what it waits on,
    as GFLOP/s, the share of the dot instructions' peak and the weight bytes a second that makes
    beside the read bandwidth (a step from memory cannot stream faster than the lower of the
    two)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import cpu_ops

    K, N = KINDS[kind]

    def run(x, w):
        total, h = jnp.zeros((rows,), jnp.float32), x[:, :K]
        for _ in range(CACHED_CALLS):
            out = cpu_ops.packed_matmul(h, w)
            total += out[:, 0]
            h = out[:, :K].astype(dtype)  # N >= K for both kinds
        return total

    seconds = median_seconds(jax.jit(run), x, packed_w, runs=15) / CACHED_CALLS
    flops, nbytes = 2 * rows * K * N, K * N * dtype.itemsize
    rate, streamed = flops / seconds / 1e9, nbytes / seconds / 1e9
    return (f"{'':>16}{kind} from cache ({nbytes / 2**20:.1f} MiB): {seconds * 1e6:.1f} us a "
            f"call, {rate:.0f} GFLOP/s ({rate / dtype_peak:.0%} of the peak), "
            f"{streamed:.1f} GB/s of weights ({streamed / bandwidth:.2f}x the read bandwidth)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--vs-xla", action="store_true", help="also time XLA:CPU's dot")
    ap.add_argument("--cached", action="store_true",
                    help="also the packed kernel on one weight called in turn from the caches "
                         "(o: L2, gate_up: L3): its arithmetic ceiling at these rows")
    args = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the CPU kernel library is not available")
    bandwidth, peak = read_gbps(), fma_peak_gflops()
    print(f"read bandwidth {bandwidth:.1f} GB/s; FMA peak {peak:.1f} GFLOP/s (every core)")
    print(f"{'dtype':>9}{'rows':>5}  {'chain':<24}{'ms':>8}{'GB/s':>7}{'of read':>9}"
          f"{'packed ms':>11}{'GB/s':>7}{'of FMA':>8}{'speedup':>9}"
          + (f"{'XLA ms':>9}{'speedup':>9}" if args.vs_xla else ""))
    rng = np.random.default_rng(0)
    for dtype in [jnp.dtype(d) for d in args.dtypes.split(",") if d]:
        layers, head, packed, packed_head = model_weights(rng, dtype)
        dtype_peak = matmul_peak_gflops(peak, dtype.name)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = jnp.asarray(rng.standard_normal((rows, INTERMEDIATE), np.float32), dtype)
            for name, kinds, with_head, in_turn in chain_cases():
                seconds = median_seconds(chain(kinds, with_head, rows, dtype, in_turn=in_turn),
                                         x, layers, head, runs=15)
                nbytes = chain_bytes(layers, head, kinds, with_head)
                rate = nbytes / seconds / 1e9
                line = (f"{dtype.name:>9}{rows:>5}  {name:<24}{seconds * 1e3:>8.2f}{rate:>7.1f}"
                        f"{rate / bandwidth:>9.0%}")
                packed_seconds = median_seconds(
                    chain(kinds, with_head, rows, dtype, in_turn=in_turn), x, packed,
                    packed_head, runs=15)
                flops = 2 * rows * nbytes / dtype.itemsize
                line += (f"{packed_seconds * 1e3:>11.2f}{nbytes / packed_seconds / 1e9:>7.1f}"
                         f"{flops / packed_seconds / 1e9 / dtype_peak:>8.0%}"
                         f"{seconds / packed_seconds:>8.2f}x")
                if args.vs_xla:
                    xla_seconds = median_seconds(chain(kinds, with_head, rows, dtype, xla,
                                                       in_turn), x, layers, head, runs=15)
                    line += f"{xla_seconds * 1e3:>9.2f}{xla_seconds / seconds:>8.2f}x"
                print(line, flush=True)
            if args.cached:
                for kind in CACHED_KINDS:
                    print(cached_line(kind, packed[0][kind], x, rows, dtype, dtype_peak,
                                      bandwidth), flush=True)


if __name__ == "__main__":
    main()
