"""`python -m jaxpage.generate`: generate text from the command line.

Examples:
  python -m jaxpage.generate --chat --prompt "What is the capital of France?"
  python -m jaxpage.generate --prompts-file prompts.txt --max-tokens 64 --json
  python -m jaxpage.generate --chat --stream --temperature 0.8 --top-p 0.95
  python -m jaxpage.generate --lora ./my-peft-adapter --prompt "SELECT"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from jaxpage.engine_args import enable_compile_cache  # noqa: F401  (public: README)

DEFAULT_PROMPT = "What is the capital of France?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jaxpage.engine_args import add_engine_args

    p = argparse.ArgumentParser(prog="python -m jaxpage.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of every request")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--beam-width", type=int, default=None, help="use beam search")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    p.add_argument("--lora", metavar="[NAME=]PATH",
                   help="run every prompt under this PEFT LoRA adapter directory (turns "
                        "--enable-lora on; --max-lora-rank for ranks over 16)")
    add_engine_args(p, exclude=("seed",))  # --seed is the requests' seed here
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file!r} has no prompts")
        return prompts
    return args.prompt or [DEFAULT_PROMPT]


def lora_request(args: argparse.Namespace):
    """The `--lora` adapter's LoRARequest (None without the flag): PATH, or NAME=PATH where
    PATH is not itself a directory."""
    from jaxpage import LoRARequest

    if args.lora is None:
        return None
    name, sep, path = args.lora.partition("=")
    if os.path.isdir(args.lora) or not sep:
        path = args.lora
        name = os.path.basename(os.path.normpath(path)) or "lora"
    if not name or not path:
        raise ValueError(f"--lora {args.lora!r}: give PATH or NAME=PATH")
    if args.enable_lora is False:
        raise ValueError("--lora needs LoRA on: drop --no-enable-lora")
    if args.beam_width is not None:
        raise ValueError("--lora: beam search does not take a LoRA adapter")
    args.enable_lora = True
    return LoRARequest(name, 1, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from jaxpage import LLM, BeamSearchParams, SamplingParams
    from jaxpage.engine import gc_tuning
    from jaxpage.engine_args import engine_config
    from jaxpage.llm import chat_token_ids

    prompts = read_prompts(args)
    lora = lora_request(args)
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    start = time.perf_counter()
    llm = LLM(config=engine_config(args))
    load_seconds = time.perf_counter() - start
    if lora is not None:
        try:
            llm.add_lora(lora)  # read and checked before any prompt runs
        except ValueError as e:
            raise ValueError(f"--lora: {e}") from e
    gc_tuning.freeze_heap()  # the engine lives as long as the process: see gc_tuning
    if args.chat:
        if llm.tokenizer is None:
            raise ValueError("--chat: this model has no tokenizer")
        inputs: list[Any] = [chat_token_ids(llm.tokenizer, [{"role": "user", "content": p}])
                             for p in prompts]
    else:
        inputs = list(prompts)
    start = time.perf_counter()
    if args.beam_width is not None:
        outputs = llm.beam_search(inputs, BeamSearchParams(
            beam_width=args.beam_width, max_tokens=args.max_tokens),
            use_tqdm=len(inputs) > 1 and not args.json)
    elif args.stream:
        outputs = stream(llm, prompts, inputs, params, lora)
    else:
        outputs = llm.generate(inputs, params, use_tqdm=len(inputs) > 1 and not args.json,
                               lora_request=lora)
    elapsed = time.perf_counter() - start
    if not args.stream or args.beam_width is not None:
        for prompt, out in zip(prompts, outputs, strict=True):
            print_output(prompt, out, args.json)
    print_summary(llm, outputs, elapsed, load_seconds)
    return 0


def stream(llm, prompts: list[str], inputs: list[Any], params, lora=None) -> list:
    """Print each request's text as it arrives (requests are prefixed when there are many)."""
    from jaxpage.llm import merge_delta

    engine = llm.engine
    ids = [f"cli-{i}" for i in range(len(inputs))]
    for request_id, prompt in zip(ids, inputs, strict=True):
        engine.add_request(request_id, prompt, params, lora_request=lora)
    merged: dict = {}
    finished: dict = {}
    many = len(ids) > 1 or params.n > 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            completions = merge_delta(merged.setdefault(out.request_id, {}), out)
            for delta in out.outputs:
                if delta.text:
                    tag = f"[{out.request_id}.{delta.index}] " if many else ""
                    print(f"{tag}{delta.text}" + ("\n" if many else ""), end="", flush=True)
            if out.finished:
                out.outputs = completions
                finished[out.request_id] = out
    print()
    return [finished[r] for r in ids]


def print_output(prompt: str, out, as_json: bool) -> None:
    if as_json:
        print(json.dumps({
            "request_id": out.request_id, "prompt": prompt,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                         "finish_reason": c.finish_reason,
                         "cumulative_logprob": c.cumulative_logprob} for c in out.outputs],
            **({"error": out.error} if out.error else {}),
        }))
        return
    print(f"--- {prompt}")
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
    for completion in out.outputs:
        prefix = f"[{completion.index}] " if len(out.outputs) > 1 else ""
        print(f"{prefix}{completion.text}")
    print()


def print_summary(llm, outputs: list, elapsed: float, load_seconds: float) -> None:
    stats = llm.stats()
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    queries = stats["prefix_cache_queries"]
    hit_rate = stats["prefix_cache_hits"] / queries if queries else 0.0
    ttft_ms = stats["ttft"]["mean"] * 1e3
    print(
        f"{len(outputs)} requests, {generated} tokens in {elapsed:.2f}s: "
        f"{generated / max(elapsed, 1e-9):.1f} tok/s | mean TTFT {ttft_ms:.0f} ms"
        f" | mean TPOT {stats['tpot']['mean'] * 1e3:.0f} ms | peak KV usage "
        f"{stats['kv_peak_usage']:.1%} | prefix-cache hit rate {hit_rate:.1%} | "
        f"{stats['compiles']} compiles ({stats['compile_seconds']:.1f}s), load {load_seconds:.1f}s"
        f" | attention {llm.attention_backend}",
        file=sys.stderr,
    )



if __name__ == "__main__":
    sys.exit(main())
