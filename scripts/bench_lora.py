"""Multi-LoRA throughput: the throughput trace with 0, 1, 4 and 16 distinct adapters against
the base model alone, on the default model (SmolLM2-135M-Instruct, bfloat16 unless --dtype),
in one process.

Adapters are written as PEFT directories (adapter_config.json + adapter_model.safetensors)
with random weights on all seven projections (q/k/v/o/gate/up/down) at each rank of --ranks;
the trace's requests take the adapters in turn (request i runs adapter i mod N). For each
rank one engine is built with enable_lora, max_loras 16 and max_lora_rank = the rank; each
configuration runs the trace once to compile its shapes, then the configurations take turns,
--repeats timed runs each (prefix cache reset before each), the fastest counting. "0 adapters"
is the LoRA engine with every request on the base model (its steps are the executables of an
engine without LoRA), the baseline each adapter count is compared with; "base (LoRA off)", an
engine built without enable_lora, is timed first for reference (on a shared machine two
engines' runs minutes apart differ by up to ~10% on their own).

Prints useful tok/s per configuration, its ratio to the baseline, and the bound the adapters' own
arithmetic sets: base FLOPs / (base + LoRA FLOPs) per token, the LoRA FLOPs of the slots as
stored (each part padded to max_lora_rank: qkv computes 3R columns, gate_up 2R).

    python scripts/bench_lora.py                     # ranks 8,16,64; 64 requests (~10 min)
    python scripts/bench_lora.py --ranks 16 --requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
from bench_common import make_llm, make_trace

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_COUNTS = (0, 1, 4, 16)


def write_adapters(directory: str, config, count: int, rank: int, seed: int = 0) -> list[str]:
    """`count` PEFT LoRA directories for a model of `config` (jaxpage's ModelConfig): random
    A and B of `rank` on all seven projections of every layer. Returns their paths."""
    from safetensors.numpy import save_file

    from jaxpage.lora import MODULES as TARGETS
    from jaxpage.lora import projection_parts

    parts = projection_parts(config)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"r{rank}-{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(config.num_layers):
            for module in MODULES:
                target, part = TARGETS[module]
                width, outs = parts[target]
                where = "self_attn" if target in ("qkv", "o") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{where}.{module}"
                tensors[f"{name}.lora_A.weight"] = (
                    rng.standard_normal((rank, width)) / np.sqrt(width)).astype(np.float32)
                tensors[f"{name}.lora_B.weight"] = (
                    rng.standard_normal((outs[part], rank)) * 0.01).astype(np.float32)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(MODULES)}, f)
        paths.append(path)
    return paths


def lora_flops_per_token(config, rank: int) -> float:
    """FLOPs one token's LoRA deltas cost over every layer, the slots as stored."""
    from jaxpage.lora import projection_parts

    total = 0
    for width, outs in projection_parts(config).values():
        r = len(outs) * rank
        total += 2 * (width * r + r * sum(outs))
    return total * config.num_layers


def base_flops_per_token(config) -> float:
    """A token's projection and LM-head FLOPs (attention's left out: the bound is on what
    the adapters add to the matmuls)."""
    from jaxpage.lora import projection_parts

    matmuls = sum(width * sum(outs) for width, outs in projection_parts(config).values())
    return 2 * (matmuls * config.num_layers + config.hidden_size * config.vocab_size)


def run_trace(llm, prompts, output_lens, loras) -> float:
    """Seconds for the trace, request i under loras[i] (None: the base model)."""
    from jaxpage import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == list(output_lens)
    return seconds


def timed(llm, prompts, output_lens, configurations: list[list], repeats: int) -> list[float]:
    """The fastest of `repeats` warm runs of each configuration (each request's adapter), the
    configurations taking turns run by run so that the machine's drift touches them alike;
    a first run of each compiles. The prefix cache is reset before each run."""
    for loras in configurations:
        run_trace(llm, prompts, output_lens, loras)
    best = [float("inf")] * len(configurations)
    for _ in range(repeats):
        for i, loras in enumerate(configurations):
            assert llm.reset_prefix_cache()
            best[i] = min(best[i], run_trace(llm, prompts, output_lens, loras))
    return best


def assignments(requests, num_adapters: int, num_requests: int) -> list:
    if num_adapters == 0:
        return [None] * num_requests
    return [requests[i % num_adapters] for i in range(num_requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--adapters", default=",".join(map(str, ADAPTER_COUNTS)))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(c) for c in args.adapters.split(",")]
    from jaxpage import LoRARequest

    base_llm = make_llm(dtype=args.dtype)
    config = base_llm.engine.model.config
    prompts, output_lens = make_trace(args.requests, 0, config.vocab_size)
    useful = sum(output_lens)
    off_s, = timed(base_llm, prompts, output_lens, [[None] * len(prompts)], args.repeats)
    del base_llm
    print(f"{args.requests} requests, {useful} useful tokens, {args.dtype}, "
          f"{os.cpu_count()} cores")
    print(f"base (LoRA off): {useful / off_s:.1f} tok/s", flush=True)
    rows = [("base (LoRA off)", "-", useful / off_s, "", 1.0)]
    counts = [0] + [c for c in counts if c]  # the base model in the LoRA engine: the baseline
    with tempfile.TemporaryDirectory() as directory:
        for rank in ranks:
            paths = write_adapters(directory, config, max(counts), rank)
            requests = [LoRARequest(f"r{rank}-{i}", i + 1, p) for i, p in enumerate(paths)]
            llm = make_llm(dtype=args.dtype, enable_lora=True, max_loras=max(16, *counts),
                           max_lora_rank=rank)
            extra = lora_flops_per_token(config, rank)
            bound = base_flops_per_token(config) / (base_flops_per_token(config) + extra)
            seconds = timed(llm, prompts, output_lens,
                            [assignments(requests, c, len(prompts)) for c in counts],
                            args.repeats)
            for count, s in zip(counts, seconds, strict=True):
                ratio = seconds[0] / s
                rows.append((f"{count} adapters", rank, useful / s, f"{ratio:.2f}x",
                             1.0 if count == 0 else bound))
                print(f"rank {rank}, {count} adapters: {useful / s:.1f} tok/s, {ratio:.2f}x "
                      f"the base model in the same engine", flush=True)
            del llm
    print()
    print("| adapters | rank | useful tok/s | vs 0 adapters (same engine) | bound (FLOPs) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rank, rate, ratio, bound in rows:
        print(f"| {name} | {rank} | {rate:.1f} | {ratio} | {bound:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(zip(("adapters", "rank", "tok_s", "vs_base", "bound"), row,
                                strict=True)) for row in rows], f, indent=1)


if __name__ == "__main__":
    main()
