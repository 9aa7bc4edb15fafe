"""Convert a model to a jaxpage checkpoint, once, so later loads skip all conversion.

    python -m jaxpage.convert SRC DST [--dtype float32|bfloat16] [--overwrite]

SRC is an HF model directory, a .gguf file, or the name `smollm2-135m-instruct`. The
checkpoint (params in the jaxpage layout, config, tokenizer) is written to DST; loading it
reads the arrays as they are, without dequantizing, renaming or transposing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxpage.config import DTYPES


def convert(src: str, dst: str, dtype: str = "float32", overwrite: bool = False) -> dict:
    """Load `src` and save it as a checkpoint at `dst`; returns what was done and timings."""
    from jaxpage.loading import load_model, resolve_model
    from jaxpage.loading.checkpoint import check_destination, save_checkpoint

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    check_destination(os.path.abspath(dst), overwrite)  # fail before the slow load
    kind, path = resolve_model(src)
    start = time.perf_counter()
    # not through the GGUF cache: the checkpoint asked for is the only one written
    config, params, tokenizer = load_model(src, dtype, cache_gguf=False)
    loaded = time.perf_counter()
    save_checkpoint(dst, config, params, tokenizer, overwrite=overwrite)
    saved = time.perf_counter()
    return {
        "kind": kind,
        "path": path,
        "config": config,
        "has_tokenizer": tokenizer is not None,
        "load_s": loaded - start,
        "save_s": saved - loaded,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpage.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="HF model dir, .gguf file, or smollm2-135m-instruct")
    parser.add_argument("dst", help="checkpoint directory to create")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="param dtype stored (default float32: dequantized GGUF weights are kept exactly)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is an existing jaxpage checkpoint",
    )
    args = parser.parse_args(argv)
    try:
        info = convert(args.src, args.dst, args.dtype, args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    config = info["config"]
    print(f"read {info['kind']} {info['path']}")
    print(
        f"  {config.architecture}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"heads {config.num_heads}/{config.num_kv_heads}, vocab {config.vocab_size}, "
        f"{config.num_params / 1e6:.1f}M params"
    )
    print(
        f"wrote checkpoint {os.path.abspath(args.dst)} ({args.dtype}"
        f"{', with tokenizer' if info['has_tokenizer'] else ', no tokenizer'})"
    )
    print(
        f"  load {info['load_s']:.2f} s + save {info['save_s']:.2f} s "
        f"= {info['load_s'] + info['save_s']:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
