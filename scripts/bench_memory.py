"""KV memory utilization, concurrency and throughput of the three reservation policies.

One ShareGPT-shaped synthetic trace is served by the same engine, the same model and the same
KV memory budget under each `reservation_policy`:

* ``paged``  -- blocks on demand (PagedAttention),
* ``oracle`` -- prompt + max_tokens reserved at admission (knows each output length),
* ``max``    -- max_model_len reserved at admission (the pre-paging baseline).

Trace (``make_trace``, fixed seed): prompt and output lengths are log-normal, as ShareGPT's
are (the vLLM paper's ShareGPT has mean input 161 / output 338 tokens, long right tails); the
defaults are scaled down for a 2-core CPU: prompt median 96 tokens (sigma 0.8), output median
160 tokens (sigma 0.6), prompt clipped to [4, max_model_len / 2], output to
[4, max_model_len - prompt]. Prompt tokens are uniform random ids. Requests arrive all at
once (default) or as a Poisson process (``--rate`` requests/s). Greedy sampling with
ignore_eos, so every policy generates exactly the same tokens.

Accounting, after every engine step, from the allocator and scheduler state (prefix caching
is off, so no block is shared and allocated slots = used blocks x block_size):

* real     -- tokens whose K/V is written: sum over running sequences of num_computed_tokens,
* reserved -- slots of blocks beyond the ceil(tokens / block_size) a sequence needs,
* fragment -- the unfilled tail of each sequence's last needed block.

Shares are time-averaged (each step weighted by its wall time less any compilation in it):
real / allocated slots. Plot time axes are serving seconds (compilation excluded).

    python scripts/bench_memory.py              # SmolLM2-135M, 24 requests (2-5 minutes)
    python scripts/bench_memory.py --quick      # tiny random model, 24 requests (seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

import numpy as np
from bench_common import make_engine, tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

POLICIES = ("paged", "oracle", "max")


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    num_requests: int = 24
    prompt_median: float = 96.0
    prompt_sigma: float = 0.8
    output_median: float = 160.0
    output_sigma: float = 0.6
    rate: float | None = None  # requests/s (Poisson); None: all at once
    seed: int = 0


def make_trace(spec: TraceSpec, vocab_size: int, max_model_len: int):
    """(prompts, output_lens, arrival offsets in seconds) for `spec`."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prompt_lens = np.clip(rng.lognormal(np.log(spec.prompt_median), spec.prompt_sigma, n),
                          4, max_model_len // 2).astype(int)
    output_lens = rng.lognormal(np.log(spec.output_median), spec.output_sigma, n)
    output_lens = np.clip(output_lens, 4, max_model_len - prompt_lens).astype(int)
    prompts = [rng.integers(2, vocab_size, size=p).tolist() for p in prompt_lens]
    if spec.rate is None:
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, n))
        arrivals -= arrivals[0]
    return prompts, output_lens.tolist(), arrivals.tolist()


# ------------------------------------------------------------------------- the KV budget

def kv_budget_bytes(model_config, block_size: int, num_blocks: int, dtype="float32") -> int:
    """kv_cache_memory that yields `num_blocks` usable blocks (+ the reserved null block)."""
    import jax.numpy as jnp

    from jaxpage.attention import kv_bytes_per_block

    per_block = kv_bytes_per_block(model_config.num_layers, block_size,
                                   model_config.num_kv_heads, model_config.head_dim,
                                   jnp.dtype(dtype))
    return per_block * (num_blocks + 1)


# ------------------------------------------------------------------------- accounting

def kv_snapshot(engine) -> dict[str, int]:
    """KV slot accounting of the engine right now (between steps)."""
    from jaxpage.engine.request import RequestStatus

    alloc = engine.allocator
    bs = alloc.block_size
    real = reserved = fragment = table_blocks = 0
    for request in engine.scheduler.running:
        computed = alloc.num_computed_tokens(request.seq_id)
        blocks = len(alloc.block_table(request.seq_id))
        need = -(-computed // bs)
        real += computed
        fragment += need * bs - computed
        reserved += (blocks - need) * bs
        table_blocks += blocks
    real_from_requests = sum(
        s.num_computed_tokens for group in engine.requests.values() for s in group.samples
        if s.status is RequestStatus.RUNNING)
    used = alloc.usage()["used"]
    return {"allocated": used * bs, "real": real, "real_from_requests": real_from_requests,
            "reserved": reserved, "fragment": fragment, "table_slots": table_blocks * bs,
            "running": len(engine.scheduler.running)}


def serve(engine, prompts, output_lens, arrivals, *, check: bool = False) -> dict:
    """Serve the trace to completion, snapshotting the KV accounting after every step."""
    from jaxpage import SamplingParams

    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    tokens: dict[str, list[int]] = {str(i): [] for i in order}
    timeline = []
    next_req = 0
    compile_before = compiled = engine.runner.compile_seconds
    start = last = time.perf_counter()
    clock = 0.0  # serving time: wall time minus compilation
    while next_req < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        if not engine.has_unfinished_requests() and arrivals[order[next_req]] > now:
            time.sleep(arrivals[order[next_req]] - now)
            now = time.perf_counter() - start
        while next_req < len(order) and arrivals[order[next_req]] <= now:
            i = order[next_req]
            engine.add_request(str(i), prompts[i], SamplingParams(
                max_tokens=output_lens[i], temperature=0.0, ignore_eos=True))
            next_req += 1
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
        t, step_compile = time.perf_counter(), engine.runner.compile_seconds - compiled
        compiled += step_compile
        snap = kv_snapshot(engine)
        snap["dt"] = max(t - last - step_compile, 0.0)
        clock += snap["dt"]
        snap["t"] = clock
        last = t
        if check:
            engine.allocator.check_invariants()
        timeline.append(snap)
    elapsed = time.perf_counter() - start
    compile_s = engine.runner.compile_seconds - compile_before
    return {"timeline": timeline, "tokens": [tokens[str(i)] for i in range(len(prompts))],
            "elapsed": elapsed, "compile_s": compile_s,
            "preemptions": engine.scheduler.num_preemptions}


def summarize(run: dict, block_size: int, num_blocks: int) -> dict:
    tl = [s for s in run["timeline"] if s["allocated"] > 0]
    w = np.array([s["dt"] for s in tl])
    steps = np.ones(len(tl))

    def share(key, weights):
        return float(sum(s[key] * x for s, x in zip(tl, weights, strict=True))
                     / sum(s["allocated"] * x for s, x in zip(tl, weights, strict=True)))

    running = np.array([s["running"] for s in tl])
    useful = sum(len(t) for t in run["tokens"])
    run_s = run["elapsed"] - run["compile_s"]
    return {
        "real_share": share("real", w), "reserved_share": share("reserved", w),
        "fragment_share": share("fragment", w), "real_share_by_step": share("real", steps),
        "mean_budget_holding_real": float((np.array([s["real"] for s in tl]) * w).sum()
                                          / w.sum() / (num_blocks * block_size)),
        "peak_running": int(running.max()), "mean_running": float((running * w).sum() / w.sum()),
        "mean_running_by_step": float(running.mean()),
        "preemptions": run["preemptions"], "useful_tokens": useful,
        "elapsed_s": run["elapsed"], "compile_s": run["compile_s"],
        "useful_tok_s": useful / run_s, "steps": len(run["timeline"]),
    }


def compare(model, params, tokenizer, spec: TraceSpec, *, block_size: int, num_blocks: int,
            max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
            policies=POLICIES, check: bool = False, log=None) -> dict[str, dict]:
    """Serve one trace under each policy with the same budget; per-policy summary + run."""
    prompts, output_lens, arrivals = make_trace(spec, model.config.vocab_size, max_model_len)
    results = {}
    for policy in policies:
        engine = make_engine(model, params, tokenizer, policy, block_size=block_size,
                             num_blocks=num_blocks + 1, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
        run = serve(engine, prompts, output_lens, arrivals, check=check)
        results[policy] = {**summarize(run, block_size, num_blocks), "run": run}
        if log:
            log(f"  {policy}: {run['elapsed']:.1f}s ({run['compile_s']:.1f}s compiling)")
        del engine
        gc.collect()
    return results


# ------------------------------------------------------------------------- output

def plot(results: dict, path: str, *, block_size: int, num_blocks: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    budget = num_blocks * block_size
    colors = {"paged": "tab:green", "oracle": "tab:orange", "max": "tab:red"}
    for policy, r in results.items():
        tl = r["run"]["timeline"]
        t = [s["t"] for s in tl]
        c = colors.get(policy)
        ax.plot(t, [100 * s["real"] / budget for s in tl], color=c,
                label=f"{policy}: real tokens ({r['real_share']:.0%} of allocated)")
        ax.plot(t, [100 * s["allocated"] / budget for s in tl], color=c, ls=":", lw=1,
                label=f"{policy}: allocated")
        ax2.plot(t, [s["running"] for s in tl], color=c,
                 label=f"{policy} (mean {r['mean_running']:.1f})")
    ax.set_xlabel("serving seconds (compilation excluded)")
    ax.set_ylabel("% of the KV budget")
    ax.set_title("KV memory holding real token states")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7)
    ax2.set_xlabel("serving seconds (compilation excluded)")
    ax2.set_ylabel("running sequences")
    ax2.set_title("concurrency")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(results: dict) -> None:
    print(f"{'policy':<8}{'real':>7}{'reserved':>10}{'frag':>7}{'peak run':>10}"
          f"{'mean run':>10}{'preempt':>9}{'tok/s':>8}{'seconds':>9}{'steps':>7}")
    for policy, r in results.items():
        print(f"{policy:<8}{r['real_share']:>7.1%}{r['reserved_share']:>10.1%}"
              f"{r['fragment_share']:>7.1%}{r['peak_running']:>10}{r['mean_running']:>10.1f}"
              f"{r['preemptions']:>9}{r['useful_tok_s']:>8.1f}{r['elapsed_s']:>9.1f}"
              f"{r['steps']:>7}")
    if "paged" in results and "max" in results:
        p, m = results["paged"], results["max"]
        print(f"paged vs max: peak running {p['peak_running'] / m['peak_running']:.2f}x, "
              f"mean running {p['mean_running'] / m['mean_running']:.2f}x, "
              f"useful tok/s {p['useful_tok_s'] / m['useful_tok_s']:.2f}x")
    same = len({json.dumps(r["run"]["tokens"]) for r in results.values()}) == 1
    print(f"identical greedy outputs across policies: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, small trace")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-seqs", type=int, default=None,
                    help="KV budget in max_model_len sequences (default 8; quick 6)")
    ap.add_argument("--plot", default="docs/kv_memory.png")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    block_size = 16
    if args.quick:
        model, params = tiny_model()
        tokenizer, name, max_model_len = None, "tiny random Llama", 512
        spec = TraceSpec(num_requests=args.requests or 24, prompt_median=48, output_median=80,
                         rate=args.rate, seed=args.seed)
        budget_seqs = args.budget_seqs or 6
    else:
        from jaxpage import LLM

        llm = LLM(max_model_len=1024, num_blocks=2)  # only to load the weights once
        model, params, tokenizer = llm.engine.model, llm.engine.runner.params, llm.engine.tokenizer
        del llm
        name, max_model_len = "SmolLM2-135M float32", 1024
        spec = TraceSpec(num_requests=args.requests or 24, rate=args.rate, seed=args.seed)
        budget_seqs = args.budget_seqs or 8
    num_blocks = budget_seqs * -(-max_model_len // block_size)
    budget = kv_budget_bytes(model.config, block_size, num_blocks)
    prompts, output_lens, _ = make_trace(spec, model.config.vocab_size, max_model_len)
    print(f"{name}; trace: {spec.num_requests} requests, seed {spec.seed}, "
          f"{'all at once' if spec.rate is None else f'Poisson {spec.rate}/s'}; prompt "
          f"lognormal(median {spec.prompt_median:g}, sigma {spec.prompt_sigma}) mean "
          f"{np.mean([len(p) for p in prompts]):.0f}, output lognormal(median "
          f"{spec.output_median:g}, sigma {spec.output_sigma}) mean {np.mean(output_lens):.0f}")
    print(f"KV budget: {num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens "
          f"({budget / 2**20:.0f} MiB) = {budget_seqs} sequences of max_model_len "
          f"{max_model_len}")
    results = compare(model, params, tokenizer, spec, block_size=block_size,
                      num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=64,
                      max_num_batched_tokens=512, log=lambda m: print(m, flush=True))
    print_table(results)
    if args.plot:
        plot(results, args.plot, block_size=block_size, num_blocks=num_blocks,
             title=f"{name}, {spec.num_requests} requests, budget {budget_seqs} x "
                   f"{max_model_len} tokens")
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({p: {k: v for k, v in r.items() if k != "run"}
                       for p, r in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
