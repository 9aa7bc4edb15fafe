"""Structured outputs' cost: the engine's decode step at batch 1, 16 and 64 with 0%, 50% and
100% of the rows under a JSON schema, and each schema's compile time, cold and cached, on the
default model (SmolLM2-135M-Instruct, bfloat16 unless --dtype).

The constrained rows' schema forces a long string (`minLength`), so no row ends inside the
measured steps; every request decodes greedily with ignore_eos. For each batch the three
mixes take turns (--rounds times, a fresh set of requests each time), each timed over
--steps decode steps once every request has its first token; the median step counts. A
constrained row's mask is filled on the host after the step's forward is dispatched
(`SamplingMetadata.pack`), so it overlaps the forward; what it cannot hide is printed
beside: the mask filling alone (`fill`, the median over the batch's matchers at the steps'
states), and that a constrained row never lets the runner start the next decode step before
this one's tokens are read (run-ahead, `lookahead_rows`).

Compile: a fresh `Grammars` (llguidance's tokenizer built first: printed), then per schema
the first matcher and its first mask (llguidance compiles lazily, the first mask is where
the work is) against a second matcher of the same schema (a copy of the cached one) and its
first mask.

    python scripts/bench_structured.py                  # batches 1,16,64; ~5 min
    python scripts/bench_structured.py --batches 2 --steps 3 --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_common import make_llm

LONG_TEXT = {"type": "object", "additionalProperties": False, "required": ["story"],
             "properties": {"story": {"type": "string", "minLength": 2000}}}
SCHEMAS = {
    "long_text": LONG_TEXT,
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 40},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "email": {"type": "string", "format": "email"}}},
    "nested_ref_anyof": {
        "$defs": {"pt": {"type": "object", "required": ["x", "y"],
                         "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
        "type": "object", "required": ["points", "kind"],
        "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/pt"},
                                  "minItems": 1, "maxItems": 16},
                       "kind": {"enum": ["line", "polygon", "cloud"]},
                       "label": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
    "tool_call_array": {
        "type": "array", "minItems": 1,
        "items": {"anyOf": [
            {"type": "object", "required": ["name", "parameters"],
             "properties": {"name": {"enum": ["get_weather"]},
                            "parameters": {"type": "object", "required": ["city"],
                                           "properties": {"city": {"type": "string"},
                                                          "unit": {"enum": ["c", "f"]}}}}},
            {"type": "object", "required": ["name", "parameters"],
             "properties": {"name": {"enum": ["search"]},
                            "parameters": {"type": "object", "required": ["query"],
                                           "properties": {"query": {"type": "string"},
                                                          "top_k": {"type": "integer"}}}}}]}},
}


def step_seconds(llm, batch: int, fraction: float, steps: int, tag: str,
                 rng: np.random.Generator) -> tuple[float, float]:
    """(median engine step seconds over `steps` decode steps, median seconds of filling one
    constrained row's mask at those steps' states) with `fraction` of `batch` rows under
    LONG_TEXT."""
    from jaxpage import SamplingParams, StructuredOutputsParams
    from jaxpage.structured import bitmask_width, fill_bitmasks

    engine = llm.engine
    free = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=LONG_TEXT))
    num_constrained = round(batch * fraction)
    for i in range(batch):
        prompt = rng.integers(100, 10_000, 32).tolist()
        engine.add_request(f"{tag}-{i}", prompt, constrained if i < num_constrained else free)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()
    times, fills = [], []
    mask = np.zeros((1, bitmask_width(engine.vocab_size)), np.int32)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        matchers = [r.matcher for r in scheduler.running if r.matcher is not None]
        if matchers:
            start = time.perf_counter()
            fill_bitmasks([(matchers[0], 0, ())], mask)
            fills.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort_request(f"{tag}-{i}")
    engine.step()
    return float(np.median(times)), float(np.median(fills)) if fills else 0.0


def compile_times(llm) -> None:
    from jaxpage import StructuredOutputsParams
    from jaxpage.structured import Grammars, bitmask_width, fill_bitmasks

    engine = llm.engine
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    _ = grammars.tokenizer
    print(f"llguidance tokenizer built in {1e3 * (time.perf_counter() - start):.0f} ms "
          f"({engine.vocab_size} tokens)")
    mask = np.zeros((1, bitmask_width(engine.vocab_size)), np.int32)
    print(f"{'schema':<18} {'cold: matcher':>14} {'+ 1st mask':>11} {'cached: matcher':>16} "
          f"{'+ 1st mask':>11}   (ms)")
    for name, schema in SCHEMAS.items():
        row = []
        for _ in range(2):  # cold, then from the cache
            start = time.perf_counter()
            matcher = grammars.matcher(StructuredOutputsParams(json=schema))
            made = time.perf_counter()
            fill_bitmasks([(matcher, 0, ())], mask)
            row += [made - start, time.perf_counter() - start]
        print(f"{name:<18} {1e3 * row[0]:>14.2f} {1e3 * row[1]:>11.2f} {1e3 * row[2]:>16.3f} "
              f"{1e3 * row[3]:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = make_llm(max_num_seqs=max(batches), dtype=args.dtype)
    compile_times(llm)
    rng = np.random.default_rng(0)
    fractions = (0.0, 0.5, 1.0)
    print(f"\ndecode step, {args.dtype}, median of {args.steps} steps x {args.rounds} rounds "
          "(the mixes taking turns), ms")
    print(f"{'batch':>5} {'0%':>8} {'50%':>8} {'100%':>8} {'50%/0%':>7} {'100%/0%':>8} "
          f"{'fill/row':>9}")
    for batch in batches:
        for fraction in fractions:  # compile each mix's shapes before timing
            step_seconds(llm, batch, fraction, 2, f"warm-{batch}-{fraction}", rng)
        results = {f: [] for f in fractions}
        fills = []
        for r in range(args.rounds):
            for fraction in fractions:
                seconds, fill = step_seconds(llm, batch, fraction, args.steps,
                                             f"b{batch}-{fraction}-{r}", rng)
                results[fraction].append(seconds)
                if fill:
                    fills.append(fill)
        ms = {f: 1e3 * float(np.median(v)) for f, v in results.items()}
        print(f"{batch:>5} {ms[0.0]:>8.2f} {ms[0.5]:>8.2f} {ms[1.0]:>8.2f} "
              f"{ms[0.5] / ms[0.0]:>7.3f} {ms[1.0] / ms[0.0]:>8.3f} "
              f"{1e3 * float(np.median(fills)):>9.3f}")


if __name__ == "__main__":
    main()
