"""One engine start, as a separate process:
`python executable_worker.py MODEL_DIR CACHE_DIR [--jax-cache-only | --prefetch]` (CACHE_DIR ''
for none; `--jax-cache-only`: JAX's cache there and no store; `--prefetch`: the warm-up's steps
loaded ahead, as the server does) builds an LLM on the tiny model, warms it up,
serves a fixed workload and prints one JSON line: every token and log-probability, the compile
count, what the executable store loaded and saved, and how many times the model's forward was
traced."""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402

CONFIG = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, block_size=16,
              dtype="float32")


def workload(llm) -> list:
    """Greedy prompts, one long enough to be chunked, and seeded samples with log-probs."""
    from jaxpage import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=7, n=2,
                             logprobs=2, ignore_eos=True)
    prompts = [list(range(3, 12)), [t % 90 + 3 for t in range(80)], list(range(5, 9))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    outputs += llm.generate([{"prompt_token_ids": prompts[0]}], sampled, use_tqdm=False)
    return [[c.token_ids, c.logprobs and [{str(k): v for k, v in step.items()}
                                          for step in c.logprobs]]
            for out in outputs for c in out.outputs]


def main(model_dir: str, cache_dir: str, flag: str | None = None) -> None:
    from jaxpage import LLM, EngineConfig
    from jaxpage.engine import executables
    from jaxpage.engine_args import enable_compile_cache
    from jaxpage.models import llama

    if cache_dir:
        enable_compile_cache(cache_dir)
    if flag == "--jax-cache-only":  # JAX's persistent cache alone, no store
        executables.keep_in(None)
    traces = []
    forward = llama.LlamaModel.forward

    def counted(self, *args, **kwargs):  # runs once per trace, never per call
        traces.append(1)
        return forward(self, *args, **kwargs)

    llama.LlamaModel.forward = counted
    config = EngineConfig(model=model_dir, **CONFIG)
    prefetch = executables.prefetch_warmup(config) if flag == "--prefetch" else None
    llm = LLM(config=config)
    if prefetch is None:
        llm.engine.warmup()
    else:
        prefetch.warm_up(llm.engine)
    tokens = workload(llm)
    runner = llm.engine.runner
    store = runner.executable_store
    print(json.dumps({"tokens": tokens, "compiles": runner.compiles, "traces": len(traces),
                      "loaded": store.loaded if store else None,
                      "saved": store.saved if store else None,
                      "prefetched": store.prefetched if store else None,
                      "ahead": prefetch.ahead if prefetch else None}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:4])
