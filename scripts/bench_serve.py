"""Serving benchmarks through the live server (`python -m jaxpage.serve`, default model).

Requests from the throughput trace (bench_common.make_trace: log-normal prompt and
output lengths, token-id prompts, ignore_eos, greedy) arrive at a Poisson rate from one
asyncio client streaming each answer. Per rate: output tokens/s, TTFT and TPOT p50/p99,
and normalized latency (end-to-end seconds per output token, the vLLM paper's measure) mean
and p99. The prefix cache is off throughout (every run recomputes every prompt), and each
server first serves the trace once unmeasured, so compilations do not land in a rate.

Three parts (all by default):
  overhead   the trace all at once through the server (streaming and not) against
             LLM.generate on the same requests in this process, the server stopped:
             what the server adds at saturation (goal: under 5%).
  policies   the paper's main serving figure: normalized latency against request rate for
             the `paged`, `oracle` (Orca-Oracle analog) and `max` (Orca-Max analog)
             reservation policies under one KV budget; the highest rate each sustains
             under the bound `--bound` (mean normalized latency, s/token).
  blocks     the paper's block-size ablation: the same sweep for `paged` at block sizes
             8, 16, 32, 64.

    python scripts/bench_serve.py                    # all (~35 minutes on 2 cores)
    python scripts/bench_serve.py --parts policies --rates 0.5 1 2 3
    python scripts/bench_serve.py --quick            # 12 requests per rate, 2 rates

The plot goes to docs/serving_latency.png, the numbers to --json if given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
from bench_common import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    VOCAB,
    make_trace,
)

# The KV budget of the policy and block-size sweeps, in tokens: small enough that the pool
# binds for every policy at the swept rates (the trace's requests average ~160 tokens)
KV_TOKENS = 3072
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # SmolLM2-135M's K and V, float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_flags(policy: str, block_size: int, kv_tokens: int | None) -> list[str]:
    flags = [f"--reservation-policy={policy}", f"--block-size={block_size}",
             f"--max-model-len={MAX_MODEL_LEN}", f"--max-num-seqs={MAX_NUM_SEQS}",
             f"--max-num-batched-tokens={MAX_NUM_BATCHED_TOKENS}",
             "--no-enable-prefix-caching"]
    if kv_tokens is not None:
        flags.append(f"--kv-cache-memory={kv_tokens * KV_BYTES_PER_TOKEN}")
    return flags


class Server:
    """`python -m jaxpage.serve` in a subprocess on a free loopback port."""

    def __init__(self, flags: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxpage.serve", "--port",
                                      str(self.port), "--log-level", "warning", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def __enter__(self) -> Server:
        import httpx

        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(1)
        raise RuntimeError("the server did not start in 900 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def one_request(client, url: str, prompt: list[int], max_tokens: int, stream: bool,
                      at: float) -> dict:
    """Send at `at` (perf_counter); returns send, first-token and end times and tokens."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    sent = time.perf_counter()
    first = None
    tokens = 0
    if stream:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif first is None:
                    first = time.perf_counter()
    else:
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        tokens = r.json()["usage"]["completion_tokens"]
    end = time.perf_counter()
    assert tokens == max_tokens, (tokens, max_tokens)
    return {"sent": sent, "first": first if first is not None else end, "end": end,
            "tokens": tokens}


def run_trace(url: str, prompts, output_lens, rate: float, stream: bool = True,
              seed: int = 0) -> dict:
    """The trace at a Poisson `rate` (requests/s; inf: all at once) against the server."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = (np.zeros(len(prompts)) if np.isinf(rate)
            else rng.exponential(1.0 / rate, len(prompts)))

    async def main():
        limits = httpx.Limits(max_connections=len(prompts) + 8)
        async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
            start = time.perf_counter() + 0.05
            arrivals = start + np.cumsum(gaps) - gaps[0]
            return await asyncio.gather(*(
                one_request(client, url, p, n, stream, float(t))
                for p, n, t in zip(prompts, output_lens, arrivals, strict=True)))

    results = asyncio.run(main())
    return summarize(results, rate)


def summarize(results: list[dict], rate: float) -> dict:
    sent = np.array([r["sent"] for r in results])
    first = np.array([r["first"] for r in results])
    end = np.array([r["end"] for r in results])
    tokens = np.array([r["tokens"] for r in results])
    ttft = first - sent
    tpot = np.where(tokens > 1, (end - first) / np.maximum(tokens - 1, 1), np.nan)
    norm = (end - sent) / tokens
    wall = end.max() - sent.min()
    return {"rate": rate, "requests": len(results), "wall_s": float(wall),
            "tok_s": float(tokens.sum() / wall),
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": float(np.nanpercentile(tpot, 50)),
            "tpot_p99": float(np.nanpercentile(tpot, 99)),
            "norm_mean": float(norm.mean()), "norm_p99": float(np.percentile(norm, 99))}


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'rate/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} "
          f"{'norm lat mean':>14} {'p99':>7}")
    for r in rows:
        print(f"{r['rate']:>7.2f} {r['tok_s']:>7.1f} {r['ttft_p50']:>8.2f}s "
              f"{r['ttft_p99']:>6.2f}s {r['tpot_p50'] * 1e3:>7.0f}ms {r['tpot_p99'] * 1e3:>5.0f}ms"
              f" {r['norm_mean']:>13.3f}s {r['norm_p99']:>6.3f}s")


def sweep(flags: list[str], prompts, output_lens, rates: list[float], title: str) -> list[dict]:
    with Server(flags) as server:
        run_trace(server.url, prompts, output_lens, float("inf"))  # compile, unmeasured
        rows = [run_trace(server.url, prompts, output_lens, rate) for rate in rates]
    print_rows(title, rows)
    return rows


def sustained(rows: list[dict], bound: float) -> float:
    """The highest swept rate whose mean normalized latency is within `bound` (0: none)."""
    ok = [r["rate"] for r in rows if r["norm_mean"] <= bound]
    return max(ok, default=0.0)


def overhead(prompts, output_lens) -> dict:
    """Saturation: the trace all at once through the server vs LLM.generate."""
    from jaxpage import LLM, SamplingParams

    flags = engine_flags("paged", 16, None)
    with Server(flags) as server:
        run_trace(server.url, prompts, output_lens, float("inf"))  # compile, unmeasured
        streamed = run_trace(server.url, prompts, output_lens, float("inf"))
        plain = run_trace(server.url, prompts, output_lens, float("inf"), stream=False)
    llm = LLM(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in output_lens]
    llm.generate(prompts, params, use_tqdm=False)  # compile
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    offline = time.perf_counter() - start
    print(f"\nsaturation ({len(prompts)} requests, {sum(output_lens)} output tokens at once):")
    print(f"  LLM.generate           {offline:7.2f} s  {sum(output_lens) / offline:6.1f} tok/s")
    for name, run in (("server, streaming", streamed), ("server, not streaming", plain)):
        print(f"  {name:22s} {run['wall_s']:7.2f} s  {run['tok_s']:6.1f} tok/s  "
              f"overhead {run['wall_s'] / offline - 1:+.1%}")
    return {"offline_s": offline, "streaming": streamed, "plain": plain}


def plot(results: dict, bound: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, v) for k, v in (("policies", results.get("policies")),
                                  ("blocks", results.get("blocks"))) if v]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (kind, curves) in zip(axes[0], panels, strict=True):
        for label, rows in curves.items():
            rates = [r["rate"] for r in rows]
            line, = ax.plot(rates, [r["norm_mean"] for r in rows], "o-", label=f"{label} mean")
            ax.plot(rates, [r["norm_p99"] for r in rows], "x--", color=line.get_color(),
                    alpha=0.6, label=f"{label} p99")
        ax.axhline(bound, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_yscale("log")
        ax.set_title("reservation policy, one KV budget" if kind == "policies"
                     else "block size (paged)")
        ax.legend(fontsize=7)
    fig.suptitle(f"jaxpage server, SmolLM2-135M float32, 2-core CPU, KV budget {KV_TOKENS} "
                 f"tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["overhead", "policies", "blocks"],
                    choices=["overhead", "policies", "blocks"])
    ap.add_argument("--requests", type=int, default=64, help="requests per rate")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 1.5, 2.0, 2.5])
    ap.add_argument("--bound", type=float, default=0.25,
                    help="normalized latency bound (mean s/token) for the sustained rate")
    ap.add_argument("--quick", action="store_true", help="12 requests, rates 1 and 3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "serving_latency.png"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rates = 12, [1.0, 3.0]
    prompts, output_lens = make_trace(args.requests, args.seed, VOCAB)
    print(f"trace: {len(prompts)} requests, {sum(map(len, prompts))} prompt and "
          f"{sum(output_lens)} output tokens; KV budget {KV_TOKENS} tokens "
          f"({KV_TOKENS * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB) for the sweeps")
    results: dict = {"requests": args.requests, "rates": args.rates, "bound": args.bound}
    if "overhead" in args.parts:
        results["overhead"] = overhead(prompts, output_lens)
    if "policies" in args.parts:
        results["policies"] = {
            policy: sweep(engine_flags(policy, 16, KV_TOKENS), prompts, output_lens,
                          args.rates, f"policy {policy}, block 16")
            for policy in ("paged", "oracle", "max")}
    if "blocks" in args.parts:
        done = results.get("policies", {}).get("paged")
        results["blocks"] = {
            f"block {bs}": (done if bs == 16 and done else sweep(
                engine_flags("paged", bs, KV_TOKENS), prompts, output_lens, args.rates,
                f"policy paged, block {bs}"))
            for bs in (8, 16, 32, 64)}
    for kind in ("policies", "blocks"):
        if kind in results:
            print(f"\nhighest rate with mean normalized latency <= {args.bound} s/token:")
            for label, rows in results[kind].items():
                print(f"  {label:8s} {sustained(rows, args.bound):.2f} req/s")
    if "policies" in results or "blocks" in results:
        plot(results, args.bound, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
