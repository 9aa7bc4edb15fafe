"""The prefix cache's host tier: a chat trace beyond the device pool, the tier on and off.

A multi-turn chat trace whose conversations together exceed the device KV pool, served with
the host tier on and off (TTFT and prefill tokens).

--conversations conversations (default 8), each its own system prompt (64 tokens), then
--turns turns of a user message (16-48 tokens) and a greedy answer (--max-tokens, 16): each
turn's prompt is the whole conversation so far. Turns go round robin (every conversation's
turn 0, then every turn 1, ...), so a conversation comes back after all the others have
been served, and the device pool (--device-blocks, default 64 blocks of 16 tokens: about
two conversations at their longest) has evicted its blocks by then. With the host tier
(swap_space for --host-blocks blocks, default 1,024) the evicted blocks wait in host memory
and the returning turn copies them back; without it (swap_space 0) it prefills them again.
Requests run one at a time, so TTFT is the request's prefill plus one step. Prefix caching
is on in both runs; generated tokens must be identical. Prefill tokens computed = prompt
tokens - tokens served from the cache (device or host hits).

    python scripts/bench_host_cache.py            # SmolLM2-135M float32 (~3 minutes)
    python scripts/bench_host_cache.py --quick    # tiny random model (seconds)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_common import make_engine, tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_one(engine, request_id: str, prompt: list[int], max_tokens: int) -> dict:
    """Serve one request alone: its tokens, TTFT, prompt tokens served from the cache and
    how many of those came from the host tier."""
    from jaxpage import SamplingParams

    host_hits = engine.stats()["prefix_cache_host_hits"]
    engine.add_request(request_id, prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, metrics = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
            metrics = out.metrics
    return {"tokens": tokens, "ttft": metrics.ttft, "prompt": len(prompt),
            "cached": metrics.num_cached_tokens,
            "host": engine.stats()["prefix_cache_host_hits"] - host_hits,
            "computed": len(prompt) - metrics.num_cached_tokens}


def chat_trace(engine, *, conversations: int, turns: int, system_len: int, max_tokens: int,
               seed: int = 0) -> list[list[dict]]:
    """rows[turn][conversation], served turn by turn, conversations round robin."""
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    history = [rng.integers(2, vocab, size=system_len).tolist() for _ in range(conversations)]
    rows = []
    for turn in range(turns):
        rows.append([])
        for c, conversation in enumerate(history):
            conversation += rng.integers(2, vocab, size=int(rng.integers(16, 49))).tolist()
            row = run_one(engine, f"c{c}-t{turn}", conversation, max_tokens)
            conversation += row["tokens"]
            rows[-1].append(row)
    return rows


def compare(new_engine, *, warmup: bool = True, **trace) -> dict:
    """The trace on a fresh engine with the host tier (`new_engine(True)`) and without."""
    out = {}
    for host_tier in (True, False):
        for _pass in range(2 if warmup else 1):  # the first pass compiles every shape
            engine = new_engine(host_tier)
            start = time.perf_counter()
            rows = chat_trace(engine, **trace)
            seconds = time.perf_counter() - start
            stats = engine.stats()
            del engine
        mode = "on" if host_tier else "off"
        out[mode], out[f"seconds_{mode}"], out[f"stats_{mode}"] = rows, seconds, stats
    return out


def summary(rows: list[dict]) -> dict:
    return {"ttft": float(np.mean([r["ttft"] for r in rows])),
            "prompt": sum(r["prompt"] for r in rows), "cached": sum(r["cached"] for r in rows),
            "host": sum(r["host"] for r in rows), "computed": sum(r["computed"] for r in rows)}


def report(res: dict) -> dict:
    """Print the table; return the headline numbers (also the checks)."""
    on, off = res["on"], res["off"]
    print(f"\n{'turn':<6}{'prompt':>8}{'cached on':>11}{'of which host':>15}{'cached off':>12}"
          f"{'computed on':>13}{'off':>7}{'TTFT on':>10}{'TTFT off':>10}{'speedup':>9}")
    for turn, (a, b) in enumerate(zip(on, off, strict=True)):
        sa, sb = summary(a), summary(b)
        print(f"{turn:<6}{sa['prompt']:>8}{sa['cached']:>11}{sa['host']:>15}{sb['cached']:>12}"
              f"{sa['computed']:>13}{sb['computed']:>7}{sa['ttft'] * 1e3:>8.1f}ms"
              f"{sb['ttft'] * 1e3:>8.1f}ms{sb['ttft'] / sa['ttft']:>8.1f}x")
    later_on = summary([r for turn in on[1:] for r in turn])
    later_off = summary([r for turn in off[1:] for r in turn])
    head = {
        "ttft_speedup": later_off["ttft"] / later_on["ttft"],
        "computed_on": later_on["computed"], "computed_off": later_off["computed"],
        "host_hit_share": later_on["host"] / later_on["prompt"],
        "identical": ([r["tokens"] for turn in on for r in turn]
                      == [r["tokens"] for turn in off for r in turn]),
        "swap_in_blocks": res["stats_on"]["swap_in_blocks"],
        "swap_out_blocks": res["stats_on"]["swap_out_blocks"],
    }
    print(f"turns 1..: TTFT {head['ttft_speedup']:.1f}x lower with the host tier, prefill "
          f"tokens computed {head['computed_on']} vs {head['computed_off']}, "
          f"{head['host_hit_share']:.1%} of prompt tokens from the host tier; "
          f"blocks copied to the host {head['swap_out_blocks']}, back {head['swap_in_blocks']}; "
          f"identical tokens on/off: {head['identical']}")
    return head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=64, help="system prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, default=64)
    ap.add_argument("--host-blocks", type=int, default=1024)
    args = ap.parse_args()
    from jaxpage.attention import kv_bytes_per_block

    block_size = 16
    if args.quick:
        model, params = tiny_model()
        name = "tiny random Llama"
        args.conversations, args.turns, args.device_blocks = 4, 3, 24
    else:
        from jaxpage import LLM

        llm = LLM(max_model_len=1024, num_blocks=2)  # only to load the weights once
        model, params = llm.engine.model, llm.engine.runner.params
        del llm
        name = "SmolLM2-135M float32"
    mc = model.config
    host_bytes = args.host_blocks * kv_bytes_per_block(mc.num_layers, block_size,
                                                       mc.num_kv_heads, mc.head_dim,
                                                       np.dtype("float32"))

    def new_engine(host_tier: bool):
        return make_engine(model, params, None, "paged", enable_prefix_caching=True,
                           block_size=block_size, num_blocks=args.device_blocks + 1,
                           swap_space=host_bytes if host_tier else 0, max_model_len=1024,
                           max_num_seqs=16, max_num_batched_tokens=512)

    print(f"{name}; {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system} tokens, {args.max_tokens} output tokens a turn, greedy, block size "
          f"{block_size}; device pool {args.device_blocks} blocks, host tier "
          f"{args.host_blocks} blocks ({host_bytes / 2**20:.0f} MiB) when on")
    start = time.perf_counter()
    res = compare(new_engine, conversations=args.conversations, turns=args.turns,
                  system_len=args.system, max_tokens=args.max_tokens)
    report(res)
    print(f"\nmeasured seconds: host tier on {res['seconds_on']:.1f}, off "
          f"{res['seconds_off']:.1f}; total run {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
