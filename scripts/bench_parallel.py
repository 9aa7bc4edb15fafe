"""Tensor parallelism: per-device weight and KV bytes, the KV pool left, the sharded step's cost.

Part "memory" (arithmetic on shapes, no weights, no devices). For SmolLM2-135M, Llama-3-8B
and Llama-3-70B shapes and every tp in 1..8 that `valid_tp_sizes` allows, the bytes each
device holds as the runner places them: `param_shapes(config)` put through the TP layout
(`TensorParallel.tp_layout`: qkv columns with each KV head repeated `kv_replicas` times, the
vocabulary padded to `padded_vocab`), each leaf cut by its `TensorParallel.param_specs` spec
(`NamedSharding(AbstractMesh).shard_shape`; norms replicated), in the chosen dtype (the
runner casts every float param to it). KV bytes per token per device are
2 (K, V) x layers x pool_kv_heads / tp x head_dim x dtype bytes. The largest KV pool is what
the runner's `_num_blocks` would size: a budget of `gpu_memory_utilization` (0.9) of the
device memory left after the weights, (memory - weights) x 0.9 (`--budget vllm`:
memory x 0.9 - weights, vLLM's rule), or 1 GiB flat on CPU, cut into whole blocks of
`--block-size` tokens, less the reserved block 0. Devices: a TPU v5e chip (16 GiB HBM; a
v5e-8 has 8), an H100 (80 GiB). Only params and the pool are counted: activations, the
compiled step's scratch and the runtime's own reserve come out of the same memory. On a
GPU the runner reads the allocator's `bytes_limit`, which JAX's default preallocation sets to
75% of the memory (XLA_PYTHON_CLIENT_MEM_FRACTION): the H100 column takes the whole 80 GiB.

The arithmetic is checked against placed arrays (sum of `shard.data.nbytes` over each
array's `addressable_shards`, per device, params and pool) of runners built in a subprocess
with 8 virtual CPU devices: SmolLM2-135M's own shapes (zero weights) at tp 1 and 3, and a
tiny 8-query / 2-KV-head Llama with a vocabulary of 130 (KV heads replicated at tp 4 and 8,
the vocabulary padded) at tp 1, 2, 4 and 8.

Part "step" (a subprocess with 8 virtual CPU devices, XLA_FLAGS set before JAX starts): a
tiny random-weight Llama (4 layers, hidden 256, intermediate 512, 8 heads / 2 KV heads,
float32, the C++ attention kernel) at tp 1, 2, 4 and 8; the median time of
`LLM(...).engine.runner.execute` for a decode step of 8 sequences at context 128 and for a
256-token prefill, after warm-up. Virtual devices share this machine's cores, so no
speed-up is expected: the figure is the overhead of the sharded step (per-device dispatch,
2 x layers + 1 all-reduces and 1 all-gather per step) against tp 1.

    python scripts/bench_parallel.py                   # both parts (~20 s on 2 cores)
    python scripts/bench_parallel.py --parts memory    # the tables (+ the check, seconds)
    python scripts/bench_parallel.py --parts step --repeats 51
    python scripts/bench_parallel.py --dtype float32 --budget vllm --json parallel.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

GiB = 1 << 30
MAX_TP = 8
UTILIZATION = 0.9  # EngineConfig.gpu_memory_utilization's default
# (name, bytes of memory per device, devices per host): the accelerators the issue asks about
ACCELERATORS = (("v5e", 16 * GiB, "v5e-8", 8), ("H100", 80 * GiB, "8xH100", 8))
CPU_KV_BUDGET = 1 * GiB  # the runner's pool on CPU (jaxpage.engine.kv_sizing.CPU_KV_BUDGET)

# name: (layers, hidden, intermediate, heads, KV heads, head_dim, vocab, tied embeddings[,
# a mixture of experts' architecture and fields: its experts split over the devices])
MODELS = {
    "SmolLM2-135M": (30, 576, 1536, 9, 3, 64, 49152, True),
    "Llama-3-8B": (32, 4096, 14336, 32, 8, 128, 128256, False),
    "Llama-3-70B": (80, 8192, 28672, 64, 8, 128, 128256, False),
    "Mixtral-8x7B": (32, 4096, 14336, 32, 8, 128, 32000, False,
                     dict(architecture="MixtralForCausalLM", num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=14336)),
    "Qwen3-30B-A3B": (48, 2048, 6144, 32, 4, 128, 151936, False,
                      dict(architecture="Qwen3MoeForCausalLM", num_experts=128,
                           num_experts_per_tok=8, moe_intermediate_size=768, qk_norm=True)),
}
# the step benchmark's model, and the memory check's tiny model (vocabulary padded at tp 4, 8)
STEP_MODEL = (4, 256, 512, 8, 2, 32, 1024, False)
CHECK_MODEL = (2, 64, 128, 8, 2, 8, 130, False)


def model_config(shape: tuple, max_position_embeddings: int = 8192):
    from jaxpage.models.config import ModelConfig

    layers, hidden, inter, heads, kv_heads, head_dim, vocab, tied, *moe = shape
    fields = {"architecture": "LlamaForCausalLM", **(moe[0] if moe else {})}
    return ModelConfig(vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=max_position_embeddings,
                       tie_word_embeddings=tied, eos_token_ids=(1,), **fields)


# ------------------------------------------------------------------------- memory arithmetic

def plan(config, tp: int):
    """The runner's TensorParallel for `tp`, over an abstract mesh (no devices needed)."""
    from jax.sharding import AbstractMesh

    from jaxpage.parallel import MODEL_AXIS, TensorParallel

    return TensorParallel(AbstractMesh((tp,), (MODEL_AXIS,)), config)


def layout_shapes(config, tp: int) -> dict:
    """Shapes of the params the runner places: `param_shapes` after `tp_layout` (tp 1: the
    single-device params as they are; a mixture of experts' experts as they are, split by
    their spec)."""
    from jaxpage.models import param_shapes

    shapes = param_shapes(config)
    return shapes if tp == 1 else plan(config, tp).layout_shapes(shapes)


def weight_bytes_per_device(config, tp: int, dtype: str) -> int:
    """Bytes of params on each device (every device holds the same share)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxpage.parallel import TensorParallel

    itemsize = jnp.dtype(dtype).itemsize
    structs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), layout_shapes(config, tp),
                           is_leaf=lambda x: isinstance(x, tuple))
    mesh = plan(config, tp).mesh
    shards = jax.tree.map(lambda a, spec: NamedSharding(mesh, spec).shard_shape(a.shape),
                          structs, TensorParallel.param_specs(structs))
    return sum(math.prod(s) * itemsize
               for s in jax.tree.leaves(shards, is_leaf=lambda x: isinstance(x, tuple)))


def kv_heads_per_device(config, tp: int) -> int:
    return plan(config, tp).pool_kv_heads // tp


def kv_bytes_per_token(config, tp: int, dtype: str) -> int:
    """Bytes one token's K and V take on each device, over all layers."""
    import jax.numpy as jnp

    from jaxpage.attention import kv_bytes_per_block

    return kv_bytes_per_block(config.num_layers, 1, kv_heads_per_device(config, tp),
                              config.head_dim, jnp.dtype(dtype))


def kv_budget(memory: int, weights: int, rule: str) -> int:
    """KV bytes per device: the runner's (memory - weights) x utilization, or vLLM's
    memory x utilization - weights."""
    if rule == "vllm":
        return int(memory * UTILIZATION) - weights
    return int(max(memory - weights, 0) * UTILIZATION)


def max_kv_tokens(budget: int, per_token: int, block_size: int) -> int | None:
    """Tokens of the pool `_num_blocks` sizes from `budget` (block 0 is reserved); None when
    the runner would refuse (fewer than 2 blocks)."""
    blocks = budget // (per_token * block_size) if budget > 0 else 0
    return (blocks - 1) * block_size if blocks >= 2 else None


def memory_table(name: str, args) -> dict:
    from jaxpage.parallel import valid_tp_sizes

    config = model_config(MODELS[name])
    total = config.num_params * _itemsize(args.dtype)
    sizes = valid_tp_sizes(config, args.max_tp)
    rows = []
    for tp in sizes:
        weights = weight_bytes_per_device(config, tp, args.dtype)
        per_token = kv_bytes_per_token(config, tp, args.dtype)
        row = {"tp": tp, "weights_per_device": weights, "weights_vs_share": weights * tp / total,
               "kv_replicas": plan(config, tp).kv_replicas,
               "kv_heads_per_device": kv_heads_per_device(config, tp),
               "kv_bytes_per_token_per_device": per_token,
               "max_kv_tokens": {"cpu_1GiB": max_kv_tokens(CPU_KV_BUDGET, per_token,
                                                           args.block_size)}}
        for acc, memory, _, _ in ACCELERATORS:
            row["max_kv_tokens"][acc] = max_kv_tokens(kv_budget(memory, weights, args.budget),
                                                      per_token, args.block_size)
        rows.append(row)
    return {"config": dataclasses.asdict(config), "params": config.num_params,
            "weight_bytes": total, "valid_tp": sizes, "rows": rows}


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def _tokens(n: int | None) -> str:
    return "no fit" if n is None else f"{n:,}"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def print_memory(name: str, table: dict, args) -> None:
    c = table["config"]
    layers, kv_heads, head_dim = c["num_layers"], c["num_kv_heads"], c["head_dim"]
    itemsize = _itemsize(args.dtype)
    skipped = [tp for tp in (1, 2, 4, 8) if tp <= args.max_tp and tp not in table["valid_tp"]]
    print(f"\n{name}: {layers} layers, hidden {c['hidden_size']}, intermediate "
          f"{c['intermediate_size']}, {c['num_heads']} heads / {kv_heads} KV heads x "
          f"{head_dim}, vocab {c['vocab_size']} ({'tied' if c['tie_word_embeddings'] else 'untied'}"
          f"); {table['params'] / 1e9:.3f} B params = {table['weight_bytes'] / 1e9:.2f} GB "
          f"({_gib(table['weight_bytes'])}) in {args.dtype}")
    print(f"  valid tp up to {args.max_tp}: {table['valid_tp']}"
          + (f" (not {', '.join(map(str, skipped))}: heads, KV heads or intermediate do not "
             f"split)" if skipped else ""))
    print(f"  KV bytes/token/device = 2 x {layers} layers x (KV heads x replicas / tp) x "
          f"{head_dim} x {itemsize} B; max tokens = (budget // block bytes - 1) x "
          f"{args.block_size}")
    accs = [f"{acc} {memory // GiB} GiB" for acc, memory, _, _ in ACCELERATORS]
    print(f"  {'tp':>3}{'weights/device':>16}{'x tp / W':>10}{'KV heads/dev':>14}"
          f"{'KV repl.':>10}{'KV B/token/dev':>16}{'tokens @ CPU 1 GiB':>20}"
          + "".join(f"{'tokens @ ' + a:>22}" for a in accs))
    for r in table["rows"]:
        print(f"  {r['tp']:>3}{_gib(r['weights_per_device']):>16}{r['weights_vs_share']:>10.4f}"
              f"{r['kv_heads_per_device']:>14}{str(r['kv_replicas']) + 'x':>10}"
              f"{r['kv_bytes_per_token_per_device']:>16,}"
              f"{_tokens(r['max_kv_tokens']['cpu_1GiB']):>20}"
              + "".join(f"{_tokens(r['max_kv_tokens'][acc]):>22}" for acc, *_ in ACCELERATORS))


def fit(config, tp: int, memory: int, args) -> tuple[int, int | None]:
    """(weight bytes per device, max KV tokens or None) at `tp` on devices of `memory`."""
    weights = weight_bytes_per_device(config, tp, args.dtype)
    return weights, max_kv_tokens(kv_budget(memory, weights, args.budget),
                                  kv_bytes_per_token(config, tp, args.dtype), args.block_size)


def verdicts(name: str, table: dict, args) -> list[str]:
    """Per host (v5e-8, 8xH100): does the model fit at the largest valid tp the host has,
    what KV it leaves, and if it does not fit the smallest tp (up to 64) that would."""
    from jaxpage.parallel import valid_tp_sizes

    config = model_config(MODELS[name])
    lines = []
    for acc, memory, host, chips in ACCELERATORS:
        tp = max(t for t in table["valid_tp"] if t <= chips)
        weights, tokens = fit(config, tp, memory, args)
        head = (f"  {name} on {host} (tp {tp}): {weights / 1e9:.2f} GB = {_gib(weights)} of "
                f"weights per {acc}")
        if tokens is None:
            more = ""
            for t in valid_tp_sizes(config, 64):
                w, n = fit(config, t, memory, args)
                if n is not None:
                    more = (f"; the smallest tp that fits on {acc} chips is {t} ({_gib(w)}/chip, "
                            f"{n:,} KV tokens)")
                    break
            lines.append(f"{head} vs {memory // GiB} GiB: DOES NOT FIT{more}")
            continue
        budget = kv_budget(memory, weights, args.budget)
        lines.append(f"{head}: fits; KV budget {_gib(budget)}/device -> {tokens:,} tokens "
                     f"(= {tokens // 8192} sequences of 8192 tokens)")
    return lines


def memory_part(args) -> dict:
    print(f"== memory: per-device bytes as the runner places them, {args.dtype}, block size "
          f"{args.block_size}; KV budget "
          + ("(memory - weights) x 0.9 (the runner's)" if args.budget == "runner"
             else "memory x 0.9 - weights (vLLM's)") + ", 1 GiB flat on CPU")
    tables = {name: memory_table(name, args) for name in MODELS}
    for name, table in tables.items():
        print_memory(name, table, args)
    print("\nper host, by this arithmetic (params and pool only):")
    for name, table in tables.items():
        table["verdicts"] = verdicts(name, table, args)
        print("\n".join(table["verdicts"]))
    return tables


# ------------------------------------------------------------------------- the child process

def run_child(tasks: list[str], args) -> dict:
    """Run `tasks` in a fresh Python with 8 virtual CPU devices; returns their JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + f" --xla_force_host_platform_device_count={MAX_TP}").strip())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", ",".join(tasks),
               "--child-out", out, "--repeats", str(args.repeats), "--dtype", args.dtype]
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            return json.load(f)


def placed_bytes(runner) -> dict[str, list[int]]:
    """Bytes per device of the runner's params and pool, from the arrays' shards."""
    import jax

    out = {}
    for key, tree in (("params", runner.params), ("pool", runner.kv_pool)):
        per_device: dict[int, int] = {}
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                per_device[shard.device.id] = per_device.get(shard.device.id, 0) + \
                    shard.data.nbytes
        out[key] = [per_device[d] for d in sorted(per_device)]
    return out


def child_check(dtype: str) -> list[dict]:
    """Placed bytes vs the arithmetic, for SmolLM2-135M shapes and a tiny Llama whose KV heads
    are replicated and whose vocabulary is padded."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpage import LLM
    from jaxpage.models.llama import LlamaModel, param_shapes
    from jaxpage.parallel import valid_tp_sizes

    results = []
    num_blocks, block_size = 8, 16
    for name, shape in (("SmolLM2-135M", MODELS["SmolLM2-135M"]), ("tiny", CHECK_MODEL)):
        config = model_config(shape, 2048)
        params = jax.tree.map(lambda s: np.zeros(s, jnp.dtype(dtype)), param_shapes(config),
                              is_leaf=lambda x: isinstance(x, tuple))
        for tp in valid_tp_sizes(config, MAX_TP):
            runner = LLM(LlamaModel(config), params=params, dtype=dtype, block_size=block_size,
                         num_blocks=num_blocks, max_model_len=256,
                         tensor_parallel_size=tp).engine.runner
            got = placed_bytes(runner)
            want = {"params": [weight_bytes_per_device(config, tp, dtype)] * tp,
                    "pool": [num_blocks * block_size * kv_bytes_per_token(config, tp, dtype)]
                    * tp}
            results.append({"model": name, "tp": tp, "placed": got, "arithmetic": want,
                            "equal": got == want})
            del runner
    return results


def child_step(repeats: int) -> list[dict]:
    """Median ms of a decode step (8 x context 128) and a 256-token prefill per tp."""
    import jax
    import numpy as np

    from jaxpage import LLM
    from jaxpage.engine.batch import SeqInput
    from jaxpage.models.llama import LlamaModel, param_shapes
    from jaxpage.sampling_params import SamplingParams, SamplingRow

    config = model_config(STEP_MODEL, 1024)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s)).astype(np.float32),
                          param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    block_size, batch, context, prompt = 16, 8, 128, 256
    row = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)
    per_seq = -(-(context + 1) // block_size)
    decode = [SeqInput(list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)), context, [5],
                       [row]) for s in range(batch)]
    first = 1 + batch * per_seq
    prefill = [SeqInput(list(range(first, first + prompt // block_size)), 0,
                        (np.arange(prompt) % config.vocab_size).tolist(), [row])]
    num_blocks = first + prompt // block_size
    results = []
    for tp in (1, 2, 4, 8):
        llm = LLM(LlamaModel(config), params=params, block_size=block_size,
                  num_blocks=num_blocks, max_model_len=512, max_num_seqs=batch,
                  max_num_batched_tokens=prompt, tensor_parallel_size=tp)
        runner = llm.engine.runner
        result = {"tp": tp, "backend": runner.backend}
        for step, seqs in (("decode", decode), ("prefill", prefill)):
            for _ in range(2):  # compile, then one more
                runner.execute(seqs)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                runner.execute(seqs)
                times.append(time.perf_counter() - start)
            result[f"{step}_ms"] = float(np.median(times)) * 1e3
            result[f"{step}_ms_min"] = float(np.min(times)) * 1e3
        print(f"  step, tp {tp}: decode {result['decode_ms']:.2f} ms, prefill "
              f"{result['prefill_ms']:.2f} ms", file=sys.stderr, flush=True)
        results.append(result)
        del llm, runner
    return results


def child_main(args) -> None:
    import jax

    assert jax.device_count() >= MAX_TP, jax.devices()
    out = {}
    for task in args.child.split(","):
        out[task] = child_check(args.dtype) if task == "check" else child_step(args.repeats)
    with open(args.child_out, "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------------- printing

def print_check(results: list[dict]) -> bool:
    ok = all(r["equal"] for r in results)
    cases = {}
    for r in results:
        cases.setdefault(r["model"], []).append(str(r["tp"]))
    print("\ncheck against placed arrays (8 virtual CPU devices, sum of shard nbytes per device, "
          "params and pool): " + ("equal" if ok else "MISMATCH") + " for "
          + "; ".join(f"{m} at tp {', '.join(t)}" for m, t in cases.items()))
    for r in results:
        if not r["equal"]:
            print(f"  {r['model']} tp {r['tp']}: placed {r['placed']} vs arithmetic "
                  f"{r['arithmetic']}")
    return ok


def print_step(results: list[dict], repeats: int) -> None:
    layers, hidden, inter, heads, kv_heads, head_dim, vocab, _ = STEP_MODEL
    print(f"\n== step: tiny random Llama ({layers} layers, hidden {hidden}, intermediate {inter},"
          f" {heads} heads / {kv_heads} KV heads x {head_dim}, vocab {vocab}, float32, "
          f"{results[0]['backend']} attention) on {MAX_TP} virtual CPU devices sharing "
          f"{os.cpu_count()} cores; median of {repeats} runner.execute calls after warm-up")
    print(f"  per step: {2 * layers + 1} all-reduces of [tokens, {hidden}] float32 (one per "
          f"o_proj and down_proj, one for the embedding) + 1 all-gather of the logits "
          f"[rows, {vocab}]; decode: 8 tokens ({8 * hidden * 4 // 1024} KiB per all-reduce), "
          f"prefill: 256 tokens ({256 * hidden * 4 // 1024} KiB)")
    print(f"  {'tp':>3}{'decode 8 x ctx 128 ms':>24}{'vs tp 1':>10}{'prefill 256 ms':>17}"
          f"{'vs tp 1':>10}")
    base = results[0]
    for r in results:
        print(f"  {r['tp']:>3}{r['decode_ms']:>24.2f}"
              f"{r['decode_ms'] / base['decode_ms'] - 1:>+10.0%}"
              f"{r['prefill_ms']:>17.2f}{r['prefill_ms'] / base['prefill_ms'] - 1:>+10.0%}")
    print("  (no speed-up is possible here: every virtual device runs on the same cores; the "
          "percentages are the cost of splitting the step, not what a real mesh gives)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="memory,step",
                    help="comma-separated: memory, step (default both)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="weights and KV dtype of the memory part")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tp", type=int, default=MAX_TP)
    ap.add_argument("--budget", default="runner", choices=("runner", "vllm"),
                    help="KV budget: runner: (memory - weights) x 0.9 (what _num_blocks does); "
                         "vllm: memory x 0.9 - weights")
    ap.add_argument("--no-check", action="store_true",
                    help="skip checking the memory arithmetic against placed arrays")
    ap.add_argument("--repeats", type=int, default=21, help="timed runs per step")
    ap.add_argument("--json", default=None, help="write all numbers to this JSON file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args)
        return
    parts = set(args.parts.split(","))
    unknown = parts - {"memory", "step"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")

    result: dict = {"dtype": args.dtype, "block_size": args.block_size, "budget": args.budget}
    tasks = ([] if args.no_check or "memory" not in parts else ["check"]) + (
        ["step"] if "step" in parts else [])
    if "memory" in parts:
        result["memory"] = memory_part(args)
    child = run_child(tasks, args) if tasks else {}
    ok = True
    if "check" in child:
        ok = print_check(child["check"])
        result["check"] = child["check"]
    if "step" in child:
        print_step(child["step"], args.repeats)
        result["step"] = child["step"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
