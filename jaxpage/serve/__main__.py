"""`python -m jaxpage.serve`: the OpenAI-compatible server.

Examples:
  python -m jaxpage.serve                         # the default model on 127.0.0.1:8000
  python -m jaxpage.serve --model ./my-hf-dir --port 8080 --api-key secret
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

logger = logging.getLogger("jaxpage.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jaxpage.engine_args import add_engine_args

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
    p.add_argument("--no-warmup", action="store_true",
                   help="skip compiling the common step shapes before serving")
    p.add_argument("--distributed", action="store_true",
                   help="one engine over several processes: jax.distributed from "
                        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (process "
                        "0 serves, the others follow it)")
    p.add_argument("--log-level", default="info")
    add_engine_args(p)
    return p.parse_args(argv)


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
    name = args.served_model_name or config.model

    def ready() -> None:
        logger.info("ready: serving %s on http://%s:%d (%.1f s after start)", name,
                    args.host, args.port, time.perf_counter() - start)

    return build_app(engine, model_name=name, api_key=args.api_key,
                     max_in_flight=args.max_in_flight, on_ready=ready)


if __name__ == "__main__":
    sys.exit(main())
