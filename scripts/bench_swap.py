"""Preemption by swapping vs by recompute: a preempted sequence's K/V cost each way, per block.

What a preempted sequence's K/V costs each way, per block, against block size (the analog of
the PagedAttention paper's Figure 19).

Measured on this machine (SmolLM2-135M float32 unless --quick): the K/V of the same T tokens
(--tokens, default 1,024) held in N = T / block_size blocks, for block sizes 8 ... 128:

* swap: the N blocks copied device -> host (`ModelRunner.swap_out`: one jitted gather and
  one device->host transfer) and back (`swap_in`: one host->device transfer and one
  jitted scatter into the donated pool), what a swapped sequence costs in all;
* recompute: the T tokens prefilled as one prompt chunk (one forward), what a recomputed
  sequence costs when it is readmitted.

Each is timed warm (after a call that compiles), best of --repeats. The byte counts that
bound the swap are printed beside it: N * block_bytes each way, block_bytes = 2 (K, V) *
layers * block_size * kv_heads * head_dim * dtype bytes.

Worked out, not measured: the same comparison for Llama-3-8B shapes on an H200 and on a TPU
v5e host, from the formula the engine's "auto" mode uses (jaxpage.engine.swap_cost):

    swap seconds per block      = 2 * block_bytes / host_link_bytes_per_s   (out, and back in)
                                + 4 * block_bytes / hbm_bytes_per_s         (gather + scatter)
    recompute seconds per block = block_size * flops_per_token / (peak_flops * mfu)
    flops_per_token             = 2 * params + 2 * layers * q_heads * head_dim * context
                                  (weights, + causal attention: QK^T and AV over half the
                                   context on average: 2 * 2 * L * H * D * context / 2)

Both sides grow linearly with block size, so the ratio per block does not depend on it; what
a real system adds is a fixed cost per transfer, which batching all of a step's blocks into
one transfer pays once per step (the measured table shows how much of it is left here).

    python scripts/bench_swap.py            # SmolLM2-135M float32 (~2 minutes)
    python scripts/bench_swap.py --quick    # tiny random model, small sizes (seconds)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_common import tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BLOCK_SIZES = (8, 16, 32, 64, 128)

# Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128, 8.03e9 parameters, bf16
LLAMA3_8B = dict(layers=32, q_heads=32, kv_heads=8, head_dim=128, params=8.03e9, dtype_bytes=2)
PLATFORMS = {  # hbm bytes/s, host link bytes/s (effective), peak bf16 dense flop/s
    "H200 (PCIe Gen5 x16)": dict(hbm=4.8e12, link=55e9, flops=989e12),
    "TPU v5e (PCIe Gen4 x16)": dict(hbm=819e9, link=25e9, flops=197e12),
}
MFU = 0.5


def best_of(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(model, params, block_size: int, num_tokens: int, repeats: int,
            dtype: str = "float32") -> dict:
    """Swap out / swap in / prefill times for `num_tokens` tokens of K/V in blocks of
    `block_size`, on one runner with exactly those blocks and a host pool as large."""
    import jax

    from jaxpage import EngineConfig, SamplingParams
    from jaxpage.attention import kv_bytes_per_block
    from jaxpage.engine.batch import SeqInput
    from jaxpage.engine.runner import ModelRunner
    from jaxpage.sampling_params import SamplingRow

    mc = model.config
    num_blocks = num_tokens // block_size
    block_bytes = kv_bytes_per_block(mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim,
                                     np.dtype(dtype) if dtype == "float32" else dtype)
    config = EngineConfig(model=type(model).__name__, dtype=dtype, block_size=block_size,
                          num_blocks=num_blocks + 1, max_num_seqs=1,
                          max_num_batched_tokens=num_tokens, swap_space=num_blocks * block_bytes,
                          enable_prefix_caching=False)
    runner = ModelRunner(model, params, config, max_model_len=num_tokens)
    table = list(range(1, num_blocks + 1))
    to_host = [(block_id, block_id - 1) for block_id in table]
    to_device = [(block_id - 1, block_id) for block_id in table]
    tokens = np.random.default_rng(0).integers(2, mc.vocab_size, size=num_tokens).tolist()
    row = SamplingRow(SamplingParams(temperature=0.0, max_tokens=1), seed=0, step=0)

    def swap_in():
        runner.swap_in(to_device)
        jax.block_until_ready(runner.kv_pool)

    def prefill():
        runner.execute([SeqInput(table, 0, tokens, [row])])

    prefill_s = best_of(prefill, repeats)  # also fills the blocks the swaps then copy
    out_s = best_of(lambda: runner.swap_out(to_host), repeats)
    in_s = best_of(swap_in, repeats)
    return {"block_size": block_size, "blocks": num_blocks, "block_bytes": block_bytes,
            "bytes": num_blocks * block_bytes, "out_s": out_s, "in_s": in_s,
            "swap_s": out_s + in_s, "prefill_s": prefill_s, "tokens": num_tokens,
            "layer_params": sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params["layers"]))}


def worked_out(platform: dict, block_size: int, context: int, shapes: dict = LLAMA3_8B,
               mfu: float = MFU) -> dict:
    """Swap and recompute seconds per block from the formula in the module docstring."""
    block_bytes = (2 * shapes["layers"] * block_size * shapes["kv_heads"] * shapes["head_dim"]
                   * shapes["dtype_bytes"])
    link_s = 2 * block_bytes / platform["link"]
    hbm_s = 4 * block_bytes / platform["hbm"]
    flops_per_token = (2 * shapes["params"] + 2 * shapes["layers"] * shapes["q_heads"]
                       * shapes["head_dim"] * context)
    recompute_s = block_size * flops_per_token / (platform["flops"] * mfu)
    return {"block_bytes": block_bytes, "link_s": link_s, "hbm_s": hbm_s,
            "swap_s": link_s + hbm_s, "flops_per_token": flops_per_token,
            "recompute_s": recompute_s}


def report_measured(rows: list[dict], name: str) -> None:
    tokens = rows[0]["tokens"]
    # the layers' weights; attention adds a little, the logits of one row next to nothing
    flops = 2 * rows[0]["layer_params"] * tokens
    print(f"\nmeasured: {name}, the K/V of {tokens} tokens; swap = out + back in, "
          f"recompute = one prefill of the {tokens} tokens "
          f"({flops / 1e9:.3g} GFLOP of layer matmuls)")
    print(f"{'block':>6}{'blocks':>8}{'KiB/block':>11}{'MB each way':>13}{'out ms':>9}"
          f"{'in ms':>8}{'out GB/s':>10}{'in GB/s':>9}{'swap us/blk':>13}"
          f"{'recomp us/blk':>15}{'recomp/swap':>13}")
    for r in rows:
        print(f"{r['block_size']:>6}{r['blocks']:>8}{r['block_bytes'] / 1024:>11.1f}"
              f"{r['bytes'] / 1e6:>13.1f}{r['out_s'] * 1e3:>9.2f}{r['in_s'] * 1e3:>8.2f}"
              f"{r['bytes'] / r['out_s'] / 1e9:>10.2f}{r['bytes'] / r['in_s'] / 1e9:>9.2f}"
              f"{r['swap_s'] / r['blocks'] * 1e6:>13.1f}"
              f"{r['prefill_s'] / r['blocks'] * 1e6:>15.1f}"
              f"{r['prefill_s'] / r['swap_s']:>12.1f}x")
    print(f"prefill of {tokens} tokens: {rows[0]['prefill_s'] * 1e3:.1f} ms at block 8 "
          f"({flops / rows[0]['prefill_s'] / 1e9:.0f} GFLOP/s of layer matmuls)")


def report_worked_out(context: int, mfu: float = MFU) -> None:
    s = LLAMA3_8B
    print(f"\nworked out: Llama-3-8B shapes ({s['layers']} layers, {s['q_heads']} query / "
          f"{s['kv_heads']} KV heads, head_dim {s['head_dim']}, {s['params']:.3g} params, "
          f"bf16), a sequence of {context} tokens, MFU {mfu:.0%}")
    print("  swap s/block      = 2 * block_bytes / link + 4 * block_bytes / hbm")
    print("  recompute s/block = block_size * (2 * params + 2 * layers * q_heads * head_dim"
          " * context) / (peak_flops * mfu)")
    for name, platform in PLATFORMS.items():
        print(f"\n{name}: HBM {platform['hbm'] / 1e12:.3g} TB/s, host link "
              f"{platform['link'] / 1e9:.0f} GB/s, {platform['flops'] / 1e12:.0f} TFLOP/s")
        print(f"{'block':>6}{'KiB/block':>11}{'link us':>9}{'HBM us':>8}{'swap us':>9}"
              f"{'recompute us':>14}{'recomp/swap':>13}")
        for block_size in BLOCK_SIZES:
            w = worked_out(platform, block_size, context, mfu=mfu)
            print(f"{block_size:>6}{w['block_bytes'] / 1024:>11.0f}{w['link_s'] * 1e6:>9.1f}"
                  f"{w['hbm_s'] * 1e6:>8.2f}{w['swap_s'] * 1e6:>9.1f}"
                  f"{w['recompute_s'] * 1e6:>14.1f}{w['recompute_s'] / w['swap_s']:>12.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of K/V (and prefill)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        model, params = tiny_model()
        name, tokens, block_sizes = "tiny random Llama float32", 128, BLOCK_SIZES[:3]
    else:
        from jaxpage import LLM

        llm = LLM(max_model_len=args.tokens, num_blocks=2)  # only to load the weights once
        model, params = llm.engine.model, llm.engine.runner.params
        del llm
        name, tokens, block_sizes = "SmolLM2-135M float32", args.tokens, BLOCK_SIZES
    start = time.perf_counter()
    rows = [measure(model, params, bs, tokens, args.repeats) for bs in block_sizes]
    report_measured(rows, name)
    report_worked_out(tokens)
    print(f"\ntotal run {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
