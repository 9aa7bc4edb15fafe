"""KV memory and throughput of parallel sampling and beam search with shared blocks.

For n = 2, 4, 8 (parallel sampling) and beam width 2, 4, 8 on a 512-token prompt with 64
output tokens, prints the peak number of KV blocks in use with sharing (one request that
forks) against the same work as N independent requests (prefix caching off for both, so
nothing is shared by the cache), and the saving. Then times n=4 and beam width 4 against 4
independent requests on the default model.

    python scripts/bench_sharing.py            # memory sweep (tiny model) + timing (SmolLM2)
    python scripts/bench_sharing.py --skip-timing
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PROMPT_LEN, OUTPUT_LEN, BLOCK = 512, 64, 16


def tiny_llm(**kwargs):
    """A 2-layer random-weight Llama: memory accounting does not depend on the weights."""
    from jaxpage import LLM
    from jaxpage.models.config import ModelConfig
    from jaxpage.models.llama import LlamaModel, param_shapes

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, max_position_embeddings=2048, eos_token_ids=(1,))
    rng = np.random.default_rng(0)
    import jax

    params = jax.tree.map(lambda shape: (0.1 * rng.standard_normal(shape)).astype(np.float32),
                          param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    return LLM(model=LlamaModel(config), params=params, block_size=BLOCK,
               enable_prefix_caching=False, **kwargs)


def peak_blocks(engine, add) -> tuple[int, float]:
    """Run `add(engine)`'s requests to completion; (peak blocks in use, seconds)."""
    add(engine)
    peak, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.allocator.usage()["used"])
    return peak, time.perf_counter() - start


def sampling_params(**kw):
    from jaxpage import SamplingParams

    return SamplingParams(max_tokens=OUTPUT_LEN, temperature=1.0, ignore_eos=True, seed=0, **kw)


def workloads(width: int, prompt: list[int]):
    from jaxpage import BeamSearchParams

    beam = BeamSearchParams(beam_width=width, max_tokens=OUTPUT_LEN, ignore_eos=True)
    return {
        f"parallel sampling n={width}": (
            lambda e: e.add_request("shared", prompt, sampling_params(n=width)),
            lambda e: [e.add_request(f"i{i}", prompt, sampling_params()) for i in range(width)]),
        f"beam search width={width}": (
            lambda e: e.add_beam_request("shared", prompt, beam),
            lambda e: [e.add_request(f"i{i}", prompt, sampling_params()) for i in range(width)]),
    }


def memory_sweep() -> list[dict]:
    prompt = [2 + i % 500 for i in range(PROMPT_LEN)]
    rows = []
    for width in (2, 4, 8):
        for name, (shared, independent) in workloads(width, prompt).items():
            llm = tiny_llm(num_blocks=1024, max_num_seqs=16, max_num_batched_tokens=1024)
            shared_peak, _ = peak_blocks(llm.engine, shared)
            independent_peak, _ = peak_blocks(llm.engine, independent)
            rows.append({"workload": name, "shared_peak_blocks": shared_peak,
                         "independent_peak_blocks": independent_peak,
                         "saved": 1 - shared_peak / independent_peak})
    return rows


def timing(width: int = 4) -> list[dict]:
    from jaxpage import LLM

    llm = LLM(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512,
              enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, size=PROMPT_LEN).tolist()
    rows = []
    for name, (shared, independent) in workloads(width, prompt).items():
        peak_blocks(llm.engine, shared)  # warm-up: compile the shapes this workload uses
        peak_blocks(llm.engine, independent)
        _, shared_s = peak_blocks(llm.engine, shared)
        _, independent_s = peak_blocks(llm.engine, independent)
        tokens = width * OUTPUT_LEN
        rows.append({"workload": name, "shared_s": shared_s, "independent_s": independent_s,
                     "shared_tok_s": tokens / shared_s,
                     "independent_tok_s": tokens / independent_s,
                     "speedup": independent_s / shared_s})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    print(f"prompt {PROMPT_LEN} tokens, {OUTPUT_LEN} output tokens, block size {BLOCK}; "
          f"prompt share of a sample's tokens: {PROMPT_LEN / (PROMPT_LEN + OUTPUT_LEN):.0%}")
    print(f"{'workload':<28}{'shared':>8}{'independent':>13}{'saved':>8}   (peak KV blocks)")
    for row in memory_sweep():
        print(f"{row['workload']:<28}{row['shared_peak_blocks']:>8}"
              f"{row['independent_peak_blocks']:>13}{row['saved']:>8.0%}")
    if args.skip_timing:
        return
    print("\nSmolLM2-135M float32, 4 continuations of one 512-token prompt (useful tok/s):")
    print(f"{'workload':<28}{'shared':>9}{'independent':>13}{'speedup':>9}")
    for row in timing():
        print(f"{row['workload']:<28}{row['shared_tok_s']:>9.1f}"
              f"{row['independent_tok_s']:>13.1f}{row['speedup']:>8.2f}x")


if __name__ == "__main__":
    main()
