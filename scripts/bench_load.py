"""Load time of the default model: from its GGUF file vs from a converted jaxpage checkpoint.

    python scripts/bench_load.py [--model smollm2-135m-instruct] [--dtype float32] [--repeats 3]

One process: the checkpoint is first written to a temp dir (with `jaxpage.convert`), then
each source is loaded `--repeats` times, alternating, and the median is reported. Params
and tokenizer are timed separately. Imports (jax, gguf, orbax, transformers) are done
before any timing, and both files sit in the OS page cache after the first read, so this
measures the loaders' own work (parsing, dequantizing, permuting, transposing vs a
straight read), not disk speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="a .gguf file or the default model's name"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import orbax.checkpoint  # noqa: F401  (imports are not what we time)
    import transformers  # noqa: F401

    from jaxpage.convert import convert
    from jaxpage.loading import resolve_model
    from jaxpage.loading.checkpoint import load_checkpoint, load_checkpoint_tokenizer
    from jaxpage.loading.gguf import gguf_tokenizer, load_gguf

    kind, gguf_path = resolve_model(args.model)
    if kind != "gguf":
        raise SystemExit(f"{args.model!r} is a {kind} model; this compares GGUF to checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "checkpoint")
        info = convert(gguf_path, ckpt, args.dtype)
        print(f"model  {gguf_path} ({os.path.getsize(gguf_path) / 2**20:.0f} MiB)")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
        print(
            f"converted to {args.dtype} checkpoint ({size / 2**20:.0f} MiB) in "
            f"{info['load_s'] + info['save_s']:.2f} s\n"
        )

        times: dict[str, list[float]] = {
            k: [] for k in ("gguf params", "gguf tokenizer", "ckpt params", "ckpt tokenizer")
        }
        for _ in range(args.repeats):
            times["gguf params"].append(timed(load_gguf, gguf_path, args.dtype)[1])
            times["gguf tokenizer"].append(timed(gguf_tokenizer, gguf_path)[1])
            times["ckpt params"].append(timed(load_checkpoint, ckpt, args.dtype, False)[1])
            times["ckpt tokenizer"].append(timed(load_checkpoint_tokenizer, ckpt)[1])

    def row(name: str, source: str) -> tuple[str, float, float, float]:
        params, tokenizer = times[f"{source} params"], times[f"{source} tokenizer"]
        return (
            name,
            statistics.median(params),
            statistics.median(tokenizer),
            params[0] + tokenizer[0],
        )

    rows = [row("GGUF", "gguf"), row("checkpoint", "ckpt")]
    base = rows[0][1] + rows[0][2]
    print(
        f"{args.dtype} params as numpy; median of {args.repeats} runs (first run in the "
        "last column)"
    )
    print(
        f"{'source':<12}{'params s':>10}{'tokenizer s':>13}{'total s':>10}{'speedup':>9}"
        f"{'first s':>10}"
    )
    for name, params_s, tokenizer_s, first in rows:
        total = params_s + tokenizer_s
        print(
            f"{name:<12}{params_s:>10.2f}{tokenizer_s:>13.2f}{total:>10.2f}"
            f"{base / total:>8.1f}x{first:>10.2f}"
        )
    print(
        f"speedup of params alone {rows[0][1] / rows[1][1]:.1f}x, of the tokenizer alone "
        f"{rows[0][2] / rows[1][2]:.1f}x"
    )


if __name__ == "__main__":
    main()
