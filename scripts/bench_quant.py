"""Weight quantization (EngineConfig.quantization): int8 and fp8 weights against bfloat16 on
the default model (SmolLM2-135M-Instruct), in one process.

Per weight format (bfloat16, then each of --formats, the activations bfloat16 throughout;
"int8+head" is int8 with quantize_lm_head):
- weight memory: llm.stats()'s weight bytes, and of those the 8-bit projections';
- the decode step at each of --batches rows (context --context), its median over --rounds
  (the formats' engines all built first and taking turns, 3 steps each, so that the machine's
  drift falls on all of them), each step beside a read of the machine's read bandwidth
  (bench_common.step_and_read), beside
  its weight-read bound: the bytes a step must read of the weights as the runner keeps them
  (every param once; an untied embedding only its rows) over that bandwidth. The ratio to
  bfloat16's step is the figure to watch: at 1 row a step is bound by reading its weights,
  and int8 / fp8 projections are half their bfloat16 bytes. That step is the runner's alone
  (`runner.execute`: the host's preparing, dispatch and readback in series with the device);
  `engine ms` is the engine's step as a request sees it (bench_common.decode_step_seconds:
  --batches requests decoding, each format 16 tokens a turn, the median step), where small
  steps run ahead and the host's work overlaps the device's;
- the throughput trace (bench_common.make_trace: --requests requests, log-normal prompt and
  output lengths, greedy), useful tokens per second;
- accuracy: the held text of bench_kv_cache read teacher-forced (chunks of 128 through a
  bfloat16 pool) against the same model with bfloat16 weights: mean and largest |log-prob
  difference| of each next token, and the share of positions whose argmax (the greedy token)
  agrees.

    python scripts/bench_quant.py                          # default model, 1/8/64 rows
    python scripts/bench_quant.py --formats int8 --batches 1 --rounds 31
    python scripts/bench_quant.py --formats int8,int8+head   # the LM head in int8 too
    python scripts/bench_quant.py --quick                  # a tiny random model, seconds

--quick runs everything at tiny settings on a random 2-layer Llama (its numbers mean nothing;
it shows the script runs end to end).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np
from bench_common import (
    decode_step_seconds,
    make_llm,
    make_trace,
    step_and_read,
    write_hf_llama,
)
from bench_kv_cache import HELD_TEXT, score_text

from jaxpage import SamplingParams
from jaxpage.layers import quantized_linear

PASS = 3  # decode steps a format runs before the next takes its turn
ENGINE_TOKENS = 16  # tokens a request decodes in a format's turn at the engine's step


def step_weight_bytes(llm, rows: int) -> int:
    """Bytes of weights a decode step of `rows` tokens reads, as the runner keeps them (8-bit
    values and their scales where quantized): every param once, except an untied embedding
    table, of which only the rows' embeddings."""
    params = llm.engine.runner.params
    total = quantized_linear.weight_bytes(params)
    if "lm_head" in params:  # untied: the table is read a row a token
        embed = params["embed"]
        total -= embed.nbytes - rows * embed.shape[1] * embed.dtype.itemsize
    return total


def trace_tok_s(llm, prompts, output_lens) -> float:
    """Useful tokens per second of the trace (compiled by a first run, then timed)."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in output_lens]
    llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return sum(output_lens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--formats", default="int8,fp8")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random model, tiny settings: checks the script runs")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    batches = [int(b) for b in args.batches.split(",")]
    model, requests, rounds, context = args.model, args.requests, args.rounds, args.context
    engine_kwargs = {}
    if args.quick:
        model = write_hf_llama(tempfile.mkdtemp(), num_hidden_layers=2, hidden_size=64,
                               intermediate_size=128)
        batches, requests, rounds, context = [b for b in batches if b <= 8][:2] or [1], 4, 2, 16
        engine_kwargs = {"max_num_seqs": 8}
    if model:
        engine_kwargs["model"] = model

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; weights vs bfloat16, "
          f"activations bfloat16; decode context {context}")
    rows: dict[str, dict] = {}
    base_scores = None
    llms = {}
    for fmt in [None, *formats]:
        quant, _, head = (fmt or "").partition("+")  # "int8+head": quantize_lm_head too
        llms[fmt or "bfloat16"] = make_llm(dtype="bfloat16", quantization=quant or None,
                                           quantize_lm_head=head == "head", **engine_kwargs)
    # the decode steps: the formats take turns, PASS rounds each, so that the machine's drift
    # over minutes falls on all of them (each step beside a read probe: step_and_read)
    for batch in batches:
        times = {name: ([], []) for name in llms}
        for _ in range(max(1, rounds // PASS)):
            for name, llm in llms.items():
                step, gbps, _ = step_and_read(llm, batch, context, rounds=PASS)
                times[name][0].append(step)
                times[name][1].append(gbps)
        engine_steps = {name: [] for name in llms}
        rng = np.random.default_rng(batch)
        for turn in range(max(1, rounds // PASS)):
            for name, llm in llms.items():
                engine_steps[name] += decode_step_seconds(llm.engine, f"{name}-{batch}-{turn}",
                                                          batch, context, ENGINE_TOKENS, rng)
        for name, (steps, rates) in times.items():
            bound = step_weight_bytes(llms[name], batch) / (float(np.median(rates)) * 1e9)
            rows.setdefault(name, {"steps": {}})["steps"][batch] = (
                float(np.median(steps)), bound, float(np.median(engine_steps[name])))
    for name, llm in llms.items():
        stats = llm.stats()
        row = rows[name]
        row.update(weight_bytes=stats["weight_bytes"],
                   quantized_bytes=stats["quantized_weight_bytes"])
        vocab = llm.engine.runner.model.config.vocab_size
        prompts, output_lens = make_trace(requests, 0, vocab)
        if args.quick:
            prompts, output_lens = [p[:24] for p in prompts], [min(n, 8) for n in output_lens]
        row["tok_s"] = trace_tok_s(llm, prompts, output_lens)
        token_ids = (llm.tokenizer.encode(HELD_TEXT) if llm.tokenizer is not None
                     else np.random.default_rng(0).integers(3, vocab, 200).tolist())
        scores = score_text(llm, token_ids, "bfloat16")
        if base_scores is None:
            base_scores = scores
        diff = np.abs(scores[0] - base_scores[0])
        row["accuracy"] = (float(diff.mean()), float(diff.max()),
                           float((scores[1] == base_scores[1]).mean()))

    base = rows["bfloat16"]
    print(f"\n{'weights':>9} {'MiB':>8} {'8-bit MiB':>10} {'x bf16':>7} {'trace tok/s':>12} "
          f"{'x bf16':>7} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'argmax agree':>13}")
    for name, row in rows.items():
        mean, most, agree = row["accuracy"]
        print(f"{name:>9} {row['weight_bytes'] / 2**20:>8.1f} "
              f"{row['quantized_bytes'] / 2**20:>10.1f} "
              f"{row['weight_bytes'] / base['weight_bytes']:>7.3f} {row['tok_s']:>12.1f} "
              f"{row['tok_s'] / base['tok_s']:>7.3f} {mean:>13.5f} {most:>12.4f} "
              f"{agree:>13.2%}")
    print(f"\n{'weights':>9} {'rows':>5} {'step ms':>8} {'x bf16':>7} {'weight bound ms':>16} "
          f"{'x bound':>8} {'engine ms':>10} {'x bf16':>7} {'x bound':>8}")
    for name, row in rows.items():
        for batch, (step, bound, engine) in row["steps"].items():
            print(f"{name:>9} {batch:>5} {step * 1e3:>8.2f} "
                  f"{step / base['steps'][batch][0]:>7.3f} {bound * 1e3:>16.2f} "
                  f"{step / bound:>8.2f} {engine * 1e3:>10.2f} "
                  f"{engine / base['steps'][batch][2]:>7.3f} {engine / bound:>8.2f}")


if __name__ == "__main__":
    main()
