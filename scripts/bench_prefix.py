"""Prefix caching: TTFT and prefill work with the cache on vs off, and cache-salt isolation.

Three workloads, each served by one engine with prefix caching on and one with it off (same
model, same budget), greedy with ignore_eos so the generated tokens must be identical:

* shared system prompt -- a `--prefix`-token system prompt (default 512) followed by
  different short questions (8-32 tokens), sent one after another; request 0 computes the
  prefix, requests 1.. find it cached (with caching on);
* multi-turn chat -- each turn's prompt is the previous turn's prompt + its answer + a new
  user message, so every turn extends the conversation the cache already holds;
* cache salt -- two tenants send the same system prompt with different `cache_salt`s: neither
  gets a hit on the other's blocks, each gets hits on its own, and an unsalted request none.

Every request runs alone (no batching), so TTFT is its own prefill plus one step; each
workload is first served once on a throwaway engine to compile its shapes. Prefill tokens
computed = prompt tokens - tokens served from the cache; hit rate = cached / prompt tokens.

    python scripts/bench_prefix.py            # SmolLM2-135M float32 (~2 minutes)
    python scripts/bench_prefix.py --quick    # tiny random model (seconds)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_common import make_engine, tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_one(engine, request_id: str, prompt: list[int], max_tokens: int,
            cache_salt: str | None = None) -> dict:
    """Serve one request alone; its tokens, TTFT and prompt tokens served from the cache."""
    from jaxpage import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True), cache_salt=cache_salt)
    tokens, metrics = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
            metrics = out.metrics
    assert metrics.num_preemptions == 0
    return {"tokens": tokens, "ttft": metrics.ttft, "prompt": len(prompt),
            "cached": metrics.num_cached_tokens,
            "computed": len(prompt) - metrics.num_cached_tokens}


def shared_prefix(engine, rng, *, prefix_len: int, num_requests: int, max_tokens: int,
                  tag: str) -> list[dict]:
    vocab = engine.vocab_size
    system = rng.integers(2, vocab, size=prefix_len).tolist()
    rows = []
    for i in range(num_requests):
        question = rng.integers(2, vocab, size=int(rng.integers(8, 33))).tolist()
        rows.append(run_one(engine, f"{tag}-sys-{i}", system + question, max_tokens))
    return rows


def multi_turn(engine, rng, *, turns: int, system_len: int, max_tokens: int,
               tag: str) -> list[dict]:
    vocab = engine.vocab_size
    conversation = rng.integers(2, vocab, size=system_len).tolist()
    rows = []
    for turn in range(turns):
        conversation += rng.integers(2, vocab, size=int(rng.integers(16, 49))).tolist()
        row = run_one(engine, f"{tag}-chat-{turn}", conversation, max_tokens)
        conversation += row["tokens"]
        rows.append(row)
    return rows


def salt_isolation(engine, rng, *, prefix_len: int, max_tokens: int) -> list[dict]:
    """Same system prompt from two salted tenants and one unsalted request."""
    vocab = engine.vocab_size
    system = rng.integers(2, vocab, size=prefix_len).tolist()
    rows = []
    for i, salt in enumerate(["tenant-a", "tenant-b", "tenant-b", "tenant-a", None]):
        question = rng.integers(2, vocab, size=16).tolist()
        row = run_one(engine, f"salt-{i}", system + question, max_tokens, cache_salt=salt)
        rows.append({**row, "salt": salt})
    return rows


def compare(new_engine, *, prefix_len: int = 512, num_requests: int = 8, turns: int = 6,
            system_len: int = 64, max_tokens: int = 16, seed: int = 0,
            warmup: bool = True) -> dict:
    """Each workload with caching on and off (`new_engine(enable_prefix_caching)`)."""
    out = {}
    for caching in (True, False):
        mode = "on" if caching else "off"
        # the first pass on a throwaway engine compiles every shape the workload uses (the
        # compiled executables are shared by all engines of the model); the second is measured
        for _pass in range(2 if warmup else 1):
            engine = new_engine(caching)
            start = time.perf_counter()
            shared = shared_prefix(engine, np.random.default_rng(seed), prefix_len=prefix_len,
                                   num_requests=num_requests, max_tokens=max_tokens, tag=mode)
            chat = multi_turn(engine, np.random.default_rng(seed + 1), turns=turns,
                              system_len=system_len, max_tokens=max_tokens, tag=mode)
            seconds = time.perf_counter() - start
            if caching:
                salt = salt_isolation(engine, np.random.default_rng(seed + 2),
                                      prefix_len=prefix_len, max_tokens=max_tokens)
            del engine
        out[f"shared_{mode}"], out[f"chat_{mode}"], out[f"seconds_{mode}"] = shared, chat, seconds
        if caching:
            out["salt"] = salt
    return out


def compare_on_off(head: dict, name: str, on: list, off: list) -> tuple[dict, dict]:
    """Record caching on vs off for the requests after the first (the ones that can hit):
    TTFT speedup, prefill tokens saved, hit rate, identical tokens. Returns both summaries."""
    s_on, s_off = summary(on[1:]), summary(off[1:])
    head[f"{name}_ttft_speedup"] = s_off["ttft"] / s_on["ttft"]
    head[f"{name}_computed_reduction"] = 1 - s_on["computed"] / s_off["computed"]
    head[f"{name}_hit_rate"] = s_on["hit_rate"]
    head[f"{name}_identical"] = [r["tokens"] for r in on] == [r["tokens"] for r in off]
    return s_on, s_off


def summary(rows: list[dict]) -> dict:
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    return {"ttft": float(np.mean([r["ttft"] for r in rows])), "prompt": prompt,
            "computed": sum(r["computed"] for r in rows), "hit_rate": cached / prompt}


def report(res: dict, block_size: int) -> dict:
    """Print the tables; return the headline numbers (also the checks)."""
    head = {}
    on, off = res["shared_on"], res["shared_off"]
    print(f"\nshared system prompt ({on[0]['prompt'] - 0} tokens incl. question for request 0)"
          f", requests served one at a time")
    print(f"{'requests':<26}{'TTFT on':>10}{'TTFT off':>10}{'speedup':>9}{'computed on':>13}"
          f"{'off':>7}{'hit rate':>10}")
    for name, a, b in [("0 (cold: computes prefix)", on[:1], off[:1]),
                       ("1.. (prefix cached)", on[1:], off[1:]), ("all", on, off)]:
        sa, sb = summary(a), summary(b)
        print(f"{name:<26}{sa['ttft'] * 1e3:>8.1f}ms{sb['ttft'] * 1e3:>8.1f}ms"
              f"{sb['ttft'] / sa['ttft']:>8.1f}x{sa['computed']:>13}{sb['computed']:>7}"
              f"{sa['hit_rate']:>10.1%}")
    warm_on, warm_off = compare_on_off(head, "shared", on, off)
    print(f"cached requests: TTFT {head['shared_ttft_speedup']:.1f}x faster, prefill tokens "
          f"computed -{head['shared_computed_reduction']:.1%} (cached share "
          f"{head['shared_hit_rate']:.1%}); identical tokens on/off: {head['shared_identical']}")

    on, off = res["chat_on"], res["chat_off"]
    print("\nmulti-turn chat (each turn = previous prompt + answer + new user message)")
    print(f"{'turn':<6}{'prompt':>8}{'cached':>8}{'TTFT on':>10}{'TTFT off':>10}{'speedup':>9}")
    for turn, (a, b) in enumerate(zip(on, off, strict=True)):
        print(f"{turn:<6}{a['prompt']:>8}{a['cached']:>8}{a['ttft'] * 1e3:>8.1f}ms"
              f"{b['ttft'] * 1e3:>8.1f}ms{b['ttft'] / a['ttft']:>8.1f}x")
    sa, sb = compare_on_off(head, "chat", on, off)
    print(f"turns 1..: TTFT {head['chat_ttft_speedup']:.1f}x faster, prefill tokens computed "
          f"{sa['computed']} vs {sb['computed']} (-{head['chat_computed_reduction']:.1%}), "
          f"hit rate {sa['hit_rate']:.1%}; identical tokens on/off: {head['chat_identical']}")

    print("\ncache salt (same system prompt, caching on)")
    print(f"{'#':<3}{'salt':<11}{'prompt':>8}{'cached':>8}")
    salt = res["salt"]
    for i, r in enumerate(salt):
        print(f"{i:<3}{r['salt'] or '(none)':<11}{r['prompt']:>8}{r['cached']:>8}")
    full = (salt[0]["prompt"] - 16) // block_size * block_size  # the system prompt's blocks
    head["salt_isolated"] = (salt[0]["cached"] == 0 and salt[1]["cached"] == 0
                             and salt[4]["cached"] == 0)
    head["salt_own_hits"] = salt[2]["cached"] >= full and salt[3]["cached"] >= full
    print(f"no cross-tenant hits: {head['salt_isolated']}; each tenant hits its own "
          f"{full}-token prefix: {head['salt_own_hits']}")
    return head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    block_size = 16
    if args.quick:
        model, params = tiny_model()
        tokenizer, name = None, "tiny random Llama"
    else:
        from jaxpage import LLM

        llm = LLM(max_model_len=1024, num_blocks=2)  # only to load the weights once
        model, params, tokenizer = llm.engine.model, llm.engine.runner.params, llm.engine.tokenizer
        del llm
        name = "SmolLM2-135M float32"

    def new_engine(caching: bool):
        return make_engine(model, params, tokenizer, "paged", enable_prefix_caching=caching,
                           block_size=block_size, num_blocks=1024, max_model_len=1024,
                           max_num_seqs=16, max_num_batched_tokens=1024)

    print(f"{name}; prefix {args.prefix} tokens, {args.requests} requests, {args.turns} chat "
          f"turns, {args.max_tokens} output tokens each, greedy, block size {block_size}")
    start = time.perf_counter()
    res = compare(new_engine, prefix_len=args.prefix, num_requests=args.requests,
                  turns=args.turns, max_tokens=args.max_tokens)
    report(res, block_size)
    print(f"\nmeasured seconds: caching on {res['seconds_on']:.1f}, off {res['seconds_off']:.1f};"
          f" total run {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
