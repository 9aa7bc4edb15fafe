"""Command-line flags for every EngineConfig field, shared by `jaxpage.generate` and
`jaxpage.serve` (one owner: a new config field is a new flag in both)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from jaxpage.cache_dir import cache_root

DEFAULT_COMPILE_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
    cache_root(), "xla")


def json_value(text: str) -> Any:
    """A flag's JSON value (`--speculative-config '{"method": "ngram"}'`)."""
    return json.loads(text)


_PARSERS = {"int": int, "float": float, "str": str, "SpeculativeConfig": json_value}


def add_engine_args(parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
    """`--model`, `--config F` (a configs/*.json preset), `--compile-cache DIR` and one flag
    per EngineConfig field not in `exclude` (`--block-size`, `--enable-prefix-caching/
    --no-...`, ...); a flag left out keeps the preset's or the config's default."""
    from jaxpage.config import EngineConfig, choices
    from jaxpage.constants import DEFAULT_MODEL

    group = parser.add_argument_group("engine (EngineConfig fields)")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="model name, HF dir, .gguf file or jaxpage checkpoint "
                            "(default %(default)s)")
    group.add_argument("--config", help="an EngineConfig preset (configs/*.json); flags "
                                        "given as well override it")
    group.add_argument("--compile-cache", default=DEFAULT_COMPILE_CACHE, metavar="DIR",
                       help="keep compiled steps here so later runs skip most compilation "
                            "(default %(default)s; '' turns it off)")
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model" or field.name in exclude:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = str(field.type).replace(" | None", "")
        help_text = f"default {field.default!r}"
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag, type=_PARSERS[kind], default=None,
                               choices=choices(field.name), help=help_text)


def engine_config(args: argparse.Namespace):
    """The EngineConfig the flags describe (ValueError naming a bad value)."""
    from jaxpage.config import EngineConfig

    overrides: dict[str, Any] = {"model": args.model}
    for field in dataclasses.fields(EngineConfig):
        value = getattr(args, field.name, None)
        if field.name != "model" and value is not None:
            overrides[field.name] = value
    if args.config:
        return EngineConfig.from_file(args.config, **overrides)
    return EngineConfig(**overrides)


def enable_compile_cache(path: str, min_compile_seconds: float = 0.0) -> None:
    """Persist compiled executables under `path` (JAX's compilation cache), so a later
    process with the same model, shapes and jax version loads them instead of compiling.
    The CLIs turn it on; library users call this once at start-up if they want it.

    Every executable is kept by default: JAX keeps only those whose compilation took at
    least `min_compile_seconds`, and most of a warm-up's step shapes compile in less than
    half a second each yet add up to most of it (the server's warm-up of SmolLM2 in
    bfloat16, 146 shapes on a 2-core Xeon: 19 entries kept at a 0.5 s minimum, 148 at 0).

    JAX's cache still traces and lowers every step on every start (its key is the lowered
    program), so engines built afterwards (on one device, in one process) also keep their
    compiled steps under `path/jaxpage-steps`, keyed by the code, versions, devices and shapes
    that made them, and a restart loads them without tracing
    (`jaxpage.engine.executables`)."""
    import jax

    from jaxpage.engine import executables

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    local = "://" not in path  # JAX's cache may be remote (gs://...); the steps' store not
    executables.keep_in(os.path.join(os.path.expanduser(path), "jaxpage-steps") if local
                        else None)
