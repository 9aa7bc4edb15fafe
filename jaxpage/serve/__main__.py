"""`python -m jaxpage.serve`: the OpenAI-compatible server.

Examples:
  python -m jaxpage.serve                         # the default model on 127.0.0.1:8000
  python -m jaxpage.serve --model ./my-hf-dir --port 8080 --api-key secret
  python -m jaxpage.serve --model ./qwen --enable-auto-tool-choice --tool-call-parser hermes
  python -m jaxpage.serve --model ./my-hf-dir --enable-lora --lora-modules sql=./sql-lora \\
       --max-lora-rank 64     # requests with "model": "sql" run under that PEFT adapter
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

logger = logging.getLogger("jaxpage.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jaxpage.engine_args import add_engine_args
    from jaxpage.serve.app import DEFAULT_MAX_REQUEST_BODY_BYTES
    from jaxpage.serve.tool_parsers import TOOL_PARSERS

    p = argparse.ArgumentParser(prog="python -m jaxpage.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (all routes but /health, "
                        "/metrics and /version)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model)")
    p.add_argument("--max-in-flight", type=int, default=4096,
                   help="requests accepted and not finished beyond which new ones get 503")
    p.add_argument("--max-request-body-bytes", type=int,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="request bodies larger than this are refused with 413 before they are "
                        "read (default: 32 MiB)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": tool calls parsed out of the text with '
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the tool-call format the model writes (hermes: <tool_call>{...}"
                        "</tool_call>; llama3_json: {\"name\": ..., \"parameters\": ...})")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip compiling the common step shapes before serving")
    p.add_argument("--distributed", action="store_true",
                   help="one engine over several processes: jax.distributed from "
                        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (process "
                        "0 serves, the others follow it)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=None,
                   metavar="NAME=PATH",
                   help="PEFT LoRA adapters served under their names (a request's model), "
                        "as NAME=PATH or JSON '{\"name\": NAME, \"path\": PATH}'; ids 1, 2, "
                        "... in order; needs --enable-lora")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 does); needs --enable-lora")
    add_engine_args(p)
    return p.parse_args(argv)


def lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` value, vLLM's forms: NAME=PATH or '{"name": ..., "path": ...}'."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from e
        unknown = set(spec) - {"name", "path"}
        if unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown keys {sorted(unknown)} (an "
                                             "adapter is {\"name\": ..., \"path\": ...})")
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH or "
                                         "'{\"name\": NAME, \"path\": PATH}'")
    return name, path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = load(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if app is None:  # a follower process: it served process 0's device calls
        return 0
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


def load(args: argparse.Namespace):
    """Load the model, warm the compiled steps up and build the app (None on a follower
    process, after process 0 has stopped)."""
    from jaxpage import LLM
    from jaxpage.engine import executables, gc_tuning
    from jaxpage.engine_args import enable_compile_cache, engine_config
    from jaxpage.serve import build_app

    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    if args.distributed:
        from jaxpage import distributed

        distributed.initialize()
    start = time.perf_counter()
    config = engine_config(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got "
                         f"{args.max_request_body_bytes}")
    for flag in ("--lora-modules", "--allow-runtime-lora-updating"):
        if getattr(args, flag[2:].replace("-", "_")) and not config.enable_lora:
            raise ValueError(f"{flag} needs --enable-lora (LoRA is off)")
    # the steps the last warm-up of this configuration used load while the model does
    prefetch = (None if args.no_warmup or args.distributed
                else executables.prefetch_warmup(config))
    try:
        llm = LLM(config=config)
    except BaseException:
        if prefetch is not None:
            prefetch.finish(None)
        raise
    engine = llm.engine
    if args.distributed and not distributed.is_leader():
        logger.info("following process 0")
        distributed.follow(llm)
        return None
    logger.info("loaded %s in %.1f s: %d KV blocks of %d tokens", config.model,
                time.perf_counter() - start, engine.stats()["kv_blocks_total"],
                config.block_size)
    name = args.served_model_name or config.model
    try:
        add_lora_modules(engine, args.lora_modules or [], name)
    except ValueError:
        if prefetch is not None:
            prefetch.finish(None)
        raise
    if not args.no_warmup:
        compiles, seconds = engine.warmup() if prefetch is None else prefetch.warm_up(engine)
        store = getattr(getattr(engine, "runner", None), "executable_store", None)
        if prefetch is not None and prefetch.ahead:
            logger.info("warm-up: %d step shapes loaded ahead in %.1f s from %s",
                        prefetch.ahead, seconds, store.directory)
        else:
            logger.info("warm-up: %d step shapes compiled in %.1f s%s", compiles, seconds,
                        f" ({store.loaded} loaded from {store.directory})" if store else "")
    gc_tuning.freeze_heap()  # the engine lives as long as the process: see gc_tuning

    def ready() -> None:
        logger.info("ready: serving %s on http://%s:%d (%.1f s after start)", name,
                    args.host, args.port, time.perf_counter() - start)

    return build_app(engine, model_name=name, api_key=args.api_key,
                     max_in_flight=args.max_in_flight, on_ready=ready,
                     allow_runtime_lora_updating=args.allow_runtime_lora_updating or None,
                     max_request_body_bytes=args.max_request_body_bytes,
                     tool_parser=args.tool_call_parser if args.enable_auto_tool_choice
                     else None)


def add_lora_modules(engine, modules: list[tuple[str, str]], model_name: str) -> None:
    """Add the `--lora-modules` adapters (ids 1, 2, ...), each read and checked now: a
    ValueError naming the first bad one."""
    from jaxpage import LoRARequest

    for lora_id, (name, path) in enumerate(modules, start=1):
        if name == model_name:
            raise ValueError(f"--lora-modules {name}={path}: {name!r} is the served model's "
                             "name")
        try:
            engine.add_lora(LoRARequest(name, lora_id, path))
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from e
        logger.info("LoRA adapter %r (id %d) from %s", name, lora_id, path)


if __name__ == "__main__":
    sys.exit(main())
