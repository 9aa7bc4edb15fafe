"""Start-up time of the server as a user meets it: `python -m jaxpage.serve --dtype bfloat16`
on the default model, from launch until `GET /health` answers, first with an empty compile
cache and then restarted on the cache that start filled.

    python scripts/bench_startup.py [--restarts 2] [--fresh] [--json out.json]

Each start is a new process on 127.0.0.1; the script reads the server's own log lines for the
load and warm-up times, and the entries the compile cache directory holds after each start,
and times one completion sent as soon as it is healthy (what the start left undone is paid
there: a restart loads its steps ahead instead of running a warm-up).
`--fresh` also starts from an empty jaxpage cache (`JAXPAGE_CACHE_DIR`: the CPU kernel
library's build and the GGUF model's conversion are then part of the first start), as a new
user's first run is. Goals (issue #61): a restart healthy within 0.25x the first start's time,
the first start under 60 s. Prints each start, then restart / first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG_TIMES = {"load": re.compile(r"loaded \S+ in ([\d.]+) s"),
             "warmup": re.compile(r"warm-up: (\d+) step shapes (?:compiled|loaded ahead) in "
                                  r"([\d.]+) s")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_request(port: int) -> float:
    """Seconds for one completion (a short prompt, 16 greedy tokens) right after /health:
    what a start left to compile or load is paid here."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        json.load(response)
    return time.perf_counter() - started


def start(compile_cache: Path, env: dict, extra: list[str], timeout: float) -> dict:
    """One server start: seconds until /health answered, and the server's own times."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    launched = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxpage.serve", "--dtype", "bfloat16", "--port", str(port),
         "--compile-cache", str(compile_cache), *extra],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited with {server.returncode}:\n"
                                   f"{log.read()[-4000:]}")
            if time.perf_counter() - launched > timeout:
                raise RuntimeError(f"not healthy after {timeout:.0f} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        healthy = time.perf_counter() - launched
        first_request = time_request(port)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    log.seek(0)
    text = log.read()
    result = {"healthy_s": round(healthy, 1), "first_request_s": round(first_request, 3)}
    if m := LOG_TIMES["load"].search(text):
        result["load_s"] = float(m.group(1))
    if m := LOG_TIMES["warmup"].search(text):
        result["warmup_shapes"], result["warmup_s"] = int(m.group(1)), float(m.group(2))
    steps = compile_cache / "jaxpage-steps"
    result["xla_cache_entries"] = sum(1 for p in compile_cache.iterdir() if p.is_file())
    result["stored_steps"] = len(list(steps.glob("*.jaxexe"))) if steps.exists() else 0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--fresh", action="store_true",
                        help="also start from an empty JAXPAGE_CACHE_DIR (kernel build and "
                             "model conversion in the first start)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("extra", nargs="*", help="more server flags (after --)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    with tempfile.TemporaryDirectory(prefix="jaxpage-startup-") as tmp:
        if args.fresh:
            env["JAXPAGE_CACHE_DIR"] = str(Path(tmp) / "jaxpage")
        cache = Path(tmp) / "xla"
        cache.mkdir()
        runs = []
        for i in range(1 + args.restarts):
            run = start(cache, env, args.extra, args.timeout)
            run["start"] = "first" if i == 0 else f"restart {i}"
            runs.append(run)
            print(json.dumps(run), flush=True)
    first = runs[0]["healthy_s"]
    restart = min(r["healthy_s"] for r in runs[1:]) if runs[1:] else None
    print(f"first start healthy after {first:.1f} s (goal < 60 s); "
          + (f"restart {restart:.1f} s = {restart / first:.2f}x the first (goal <= 0.25x)"
             if restart else "no restart"))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=1))


if __name__ == "__main__":
    main()
