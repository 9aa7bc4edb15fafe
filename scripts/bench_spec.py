"""Speculative decoding on against off, on the default model (SmolLM2-135M-Instruct,
bfloat16 unless --dtype), greedy, at several batch sizes, in one process.

Two kinds of chat prompts: grounded ones, whose answer repeats their input (quote this
passage, repeat this code, continue this list), where prompt lookup finds what comes next,
and open-ended ones, where it rarely does. Each batch of B requests cycles through the kind's
prompts; every configuration runs once to compile its shapes and is then timed on a second,
identical run (the engines' prefix caches are reset in between), --repeats times, the two
engines alternating, the fastest counting. The tokens with and without speculation are
compared (the column "same").

Prints, per kind and batch: TPOT (mean over requests of (finish - first token) / (tokens - 1))
and tok/s off and on with their ratios, the acceptance rate and mean acceptance length (tokens
a verification emits), and the decode step's weight-read bound at that batch (bytes of weights
over this machine's measured read bandwidth: a step without drafts costs at least that, and
with drafts that emit L tokens a step, TPOT can reach bound / L). Then where the time of a
step goes with speculation on, at the smallest and largest batch: proposing (the n-gram
lookups), the rest of scheduling, the device call (verification: forward and draws), and the
update (acceptance, rewinding, appending).

    python scripts/bench_spec.py                       # batches 1, 4, 16, 64; k = 4
    python scripts/bench_spec.py --batches 1,64 --k 3 --max-tokens 96
    python scripts/bench_spec.py --json out.json
    python scripts/bench_spec.py --draft-layers 3      # the model's first 3 layers draft
    python scripts/bench_spec.py --draft-model PATH    # a draft model of its own
    python scripts/bench_spec.py --draft-model first:3 # the first 3 layers, written as a
                                                       # checkpoint of their own (own pool)

Goals (issue #62): n-gram at batch 1 on grounded prompts at least 2x lower TPOT; open-ended
prompts no worse than 0.95x; batch 64 no slower than without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index + 1 >= window:
            result.append(total / window)
    return result'''

PASSAGE = ("The river rises in the hills above the town and runs for forty miles to the sea. "
           "In spring the snow melts and the water climbs the stone steps of the old mill; in "
           "summer children swim in the pool below the bridge, and in autumn the leaves turn "
           "the surface red and gold.")

POEM = ("Once more the morning light comes over the hill, the sheep walk slowly down the "
        "lane, the farmer opens the gate and the dog runs ahead of him to the field where the "
        "grass is wet and the air is cold and clear.")

# answers that repeat their prompt, as SmolLM2-135M gives them: it quotes passages word for
# word and repeats code and lists, but asked to edit code it writes code of its own (a
# bigger model's edits repeat most of the input; this one's do not, so none is here)
GROUNDED = [
    f"Quote the following passage word for word, then say nothing else:\n\n{PASSAGE}",
    f"Repeat this passage exactly:\n\n{POEM}",
    f"Repeat the following code exactly:\n\n{CODE}",
    "Continue this list with the next ten lines in the same format:\n" + "\n".join(
        f"{i}. Item number {i} is kept in crate {i}." for i in range(1, 9)),
]

OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe your ideal weekend in a few sentences.",
    "Why is the sky blue? Explain it to a ten-year-old.",
]


def run_batch(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Generate greedily for every prompt; returns tokens, wall time, TPOT, phases, counts."""
    from jaxpage import SamplingParams

    engine = llm.engine
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before_phases = engine.step_phases()
    before_steps = engine.num_steps
    before_spec = engine.stats()["spec_decode"]
    proposer = engine.scheduler.proposer
    propose_seconds = [0.0]
    if proposer is not None:  # time the proposer's own work inside scheduling
        original = type(proposer).propose  # (a draft model's: the runner's device steps,
        # which count in the device column)

        def timed(tokens, k):
            start = time.perf_counter()
            try:
                return original(proposer, tokens, k)
            finally:
                propose_seconds[0] += time.perf_counter() - start

        proposer.propose = timed
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    if proposer is not None:
        del proposer.propose
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    tpots = [m.tpot for m in (o.metrics for o in outs) if m is not None and m.tpot is not None]
    phases = {k: v - before_phases[k] for k, v in engine.step_phases().items()}
    steps = engine.num_steps - before_steps
    result = {"tokens": tokens, "wall_s": wall, "tok_per_s": sum(map(len, tokens)) / wall,
              "tpot_ms": 1e3 * float(np.mean(tpots)) if tpots else float("nan"),
              "steps": steps, "phases_ms_per_step": {
                  k: 1e3 * v / max(steps, 1) for k, v in phases.items()},
              "propose_ms_per_step": 1e3 * propose_seconds[0] / max(steps, 1)}
    after_spec = engine.stats()["spec_decode"]
    if after_spec is not None:
        drafts = after_spec["num_drafts"] - before_spec["num_drafts"]
        proposed = after_spec["num_draft_tokens"] - before_spec["num_draft_tokens"]
        accepted = after_spec["num_accepted_tokens"] - before_spec["num_accepted_tokens"]
        result.update(drafts=drafts, draft_tokens=proposed, accepted=accepted,
                      acceptance_rate=accepted / proposed if proposed else 0.0,
                      mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)
    return result


def speculation_modes(llm) -> dict[str, tuple]:
    """{"off", "on"}: the scheduler's speculative parts (config, proposer, step cost) and the
    runner's draft model (whose own pool's forward runs every step) each mode sets
    (`switch`). One engine, not two: two engines in one process, each with its own weights
    and pool, differed by up to 9% in the same decode steps (memory placement), more than
    the effect measured. (A draft's own pool misses the steps run with it off; the prefix
    cache is reset before each run, so no run reads what it missed.)"""
    scheduler = llm.engine.scheduler
    return {"off": (None, None, None, None),
            "on": (scheduler.speculative, scheduler.proposer, scheduler.step_cost,
                   llm.engine.runner._draft)}


def switch(llm, parts: tuple) -> None:
    scheduler = llm.engine.scheduler
    scheduler.speculative, scheduler.proposer, scheduler.step_cost, draft = parts
    llm.engine.runner._draft = draft


def first_layers_checkpoint(layers: int, dtype: str, directory: str) -> str:
    """The default model's first `layers` layers (then its final norm and LM head) written
    as a jaxpage checkpoint of their own: a draft model that proposes what the target cut
    to those layers proposes, run on a pool of its own."""
    import dataclasses

    from jaxpage.constants import DEFAULT_MODEL
    from jaxpage.loading import load_model
    from jaxpage.loading.checkpoint import save_checkpoint

    config, params, tokenizer = load_model(DEFAULT_MODEL, dtype)
    types = config.layer_types
    config = dataclasses.replace(config, num_layers=layers,
                                 layer_types=None if types is None else types[:layers])
    path = os.path.join(directory, f"first-{layers}")
    save_checkpoint(path, config, dict(params, layers=params["layers"][:layers]), tokenizer)
    return path


def merge(parts: list[dict]) -> dict:
    """The sums over a configuration's rounds of concurrent requests."""
    merged = {"tokens": [t for p in parts for t in p["tokens"]]}
    for key in ("wall_s", "steps", "drafts", "draft_tokens", "accepted"):
        if key in parts[0]:
            merged[key] = sum(p[key] for p in parts)
    steps = max(merged["steps"], 1)
    merged["propose_ms_per_step"] = sum(p["propose_ms_per_step"] * p["steps"]
                                        for p in parts) / steps
    merged["tok_per_s"] = sum(map(len, merged["tokens"])) / merged["wall_s"]
    merged["tpot_ms"] = float(np.mean([p["tpot_ms"] for p in parts]))
    merged["phases_ms_per_step"] = {
        k: sum(p["phases_ms_per_step"][k] * p["steps"] for p in parts) / steps
        for k in parts[0]["phases_ms_per_step"]}
    if "drafts" in merged:
        merged["acceptance_rate"] = merged["accepted"] / max(merged["draft_tokens"], 1)
        merged["mean_acceptance_length"] = (1 + merged["accepted"] / merged["drafts"]
                                            if merged["drafts"] else 0.0)
    return merged


def measure(llm, modes: dict, prompts: list[list[int]], batch: int, max_tokens: int,
            repeats: int) -> dict:
    """Every prompt in rounds of `batch` concurrent requests (at least one request per
    prompt), in each mode (off, on) once to compile, then `repeats` times alternating
    (a slow spell of a shared machine hits both); each mode's fastest repeat, and how
    many requests got the same tokens with speculation as without (in bfloat16 a token's
    logits computed with its drafts, not alone, can round a near-tie the other way; in
    float32 the tests find them equal)."""
    requests = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    rounds = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    for parts in modes.values():
        switch(llm, parts)
        for part in rounds:
            run_batch(llm, part, max_tokens)
    timed: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(repeats):
        for name, parts in modes.items():
            switch(llm, parts)
            timed[name].append(merge([run_batch(llm, part, max_tokens) for part in rounds]))
    runs = {name: min(results, key=lambda r: r["wall_s"]) for name, results in timed.items()}
    tokens = {name: run.pop("tokens") for name, run in runs.items()}
    runs["same_tokens"] = sum(a == b for a, b in zip(tokens["on"], tokens["off"], strict=True))
    runs["requests"] = len(requests)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--fixed", action="store_true",
                        help="adaptive false: every step proposes up to k")
    parser.add_argument("--draft-layers", type=int,
                        help="draft with the model's first N layers (method draft_model, model "
                             "self) instead of prompt lookup")
    parser.add_argument("--draft-model",
                        help="draft with this model (method draft_model, a pool of its own); "
                             "first:N writes the model's first N layers as one")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kinds", default="grounded,open")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of each engine, alternating (the fastest counts)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from bench_common import make_llm, read_gbps, weight_read_bytes

    from jaxpage.llm import chat_token_ids

    batches = [int(b) for b in args.batches.split(",")]
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    method = f"n-gram, k={args.k}"
    if args.draft_layers:
        spec = {"method": "draft_model", "model": "self", "draft_layers": args.draft_layers,
                "num_speculative_tokens": args.k}
        method = f"the first {args.draft_layers} layers as the draft, k={args.k}"
    draft_dir = tempfile.TemporaryDirectory()
    if args.draft_model:
        path = args.draft_model
        if path.startswith("first:"):
            path = first_layers_checkpoint(int(path[len("first:"):]), args.dtype,
                                           draft_dir.name)
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": args.k}
        method = f"draft model {args.draft_model}, k={args.k}"
    spec["adaptive"] = not args.fixed
    method += ", fixed k" if args.fixed else ", adaptive"
    llm = make_llm(max(batches), args.dtype, speculative_config=spec)
    modes = speculation_modes(llm)
    tokenizer = llm.tokenizer
    config = llm.engine.model.config
    gbps = read_gbps()
    itemsize = 2 if args.dtype == "bfloat16" else 4
    kinds = {"grounded": GROUNDED, "open": OPEN}
    print(f"speculative decoding ({method}) on vs off; {args.dtype}, "
          f"max_tokens {args.max_tokens}, greedy; read bandwidth {gbps:.1f} GB/s")
    header = (f"{'kind':9} {'batch':>5} {'TPOT off':>9} {'TPOT on':>8} {'ratio':>6} "
              f"{'tok/s off':>9} {'tok/s on':>8} {'ratio':>6} {'accept':>6} {'mean len':>8} "
              f"{'bound ms':>8} {'same':>7}")
    print(header)
    results = {"k": args.k, "draft_layers": args.draft_layers,
               "draft_model": args.draft_model, "dtype": args.dtype,
               "max_tokens": args.max_tokens, "read_gbps": gbps, "runs": []}
    for kind in args.kinds.split(","):
        prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": text}])
                   for text in kinds[kind]]
        for batch in batches:
            runs = measure(llm, modes, prompts, batch, args.max_tokens, args.repeats)
            off, on = runs["off"], runs["on"]
            bound = 1e3 * weight_read_bytes(config, itemsize, batch) / (gbps * 1e9)
            print(f"{kind:9} {batch:5d} {off['tpot_ms']:9.2f} {on['tpot_ms']:8.2f} "
                  f"{off['tpot_ms'] / on['tpot_ms']:5.2f}x {off['tok_per_s']:9.1f} "
                  f"{on['tok_per_s']:8.1f} {on['tok_per_s'] / off['tok_per_s']:5.2f}x "
                  f"{on['acceptance_rate']:6.2f} {on['mean_acceptance_length']:8.2f} "
                  f"{bound:8.2f} {runs['same_tokens']:3d}/{runs['requests']:<3d}", flush=True)
            results["runs"].append({"kind": kind, "batch": batch, "bound_ms": bound, **runs})
    print("\nwhere a step's time goes with speculation on (ms per step)")
    print(f"{'kind':9} {'batch':>5} {'propose':>8} {'schedule':>8} {'device':>8} "
          f"{'update':>8} {'outputs':>8} {'steps':>6}")
    for run in results["runs"]:
        if run["batch"] not in (min(batches), max(batches)):
            continue
        on = run["on"]
        p = on["phases_ms_per_step"]
        device = sum(v for k, v in p.items() if k not in ("schedule", "update", "outputs"))
        print(f"{run['kind']:9} {run['batch']:5d} {on['propose_ms_per_step']:8.3f} "
              f"{p['schedule'] - on['propose_ms_per_step']:8.3f} {device:8.2f} "
              f"{p['update']:8.3f} {p['outputs']:8.3f} {on['steps']:6d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
