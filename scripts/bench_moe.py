"""MoE decode step time on CPU: grouped experts against the dense reference and a tiled loop.

The grouped experts (`jaxpage.models.moe.grouped_experts`, two `jax.lax.ragged_dot`s over
only the routed (token, expert) pairs) against the dense reference (`dense_experts`: every
expert on every token, unrouted ones weighted 0), and the tiled loop (`tiled_experts`: the
routed pairs in tiles of 8 rows, one expert per tile).

The model is Qwen3-30B-A3B scaled down: its hidden 2048 / expert width 768 / 128 experts /
top-8 / 48 layers become, by default, hidden 512 / expert width 192 (the same 8:3 ratio) /
64 experts / top-8 / 4 layers, every layer MoE, float32, random weights. Each case is one
decode step of the whole model (attention through the paged pool included, the same in
all three) for 1, 16 and 64 sequences at a short context, jitted, warmed up, then timed over
--iters steps. Printed per batch: milliseconds per step for each, the dense/grouped ratio,
and the expert FLOPs each does: routed only (T * k pairs) and all experts (T * E), whose
ratio E / k bounds the speedup grouping can bring; then the FLOPs XLA's cost analysis counts
in each compiled step (whole model). On a CPU the grouped step counts about k times the dense
one: XLA:CPU has no ragged dot, so jax lowers ragged_dot to one masked copy of the lhs per
group and a dense dot over them (`_ragged_dot_general_impl`), all E experts on all T * k
rows; GPUs and TPUs lower it to a grouped kernel instead. (The tiled step has no such
column: cost analysis counts a loop's body once.)

    python scripts/bench_moe.py
    python scripts/bench_moe.py --experts 16 --top-k 4 --batches 1,16 --iters 3
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.models import param_shapes
from jaxpage.models.config import ModelConfig
from jaxpage.models.moe import MoeModel, dense_experts, grouped_experts, tiled_experts

BLOCK = 16


def make_config(args) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, num_layers=args.layers, num_heads=8,
        num_kv_heads=2, head_dim=args.hidden // 8, max_position_embeddings=4096,
        qk_norm=True, num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True)


def random_params(config: ModelConfig, seed: int = 0):
    """Weights of unit-variance outputs (norms 1), so routing spreads over the experts."""
    rng = np.random.default_rng(seed)

    def init(shape):
        if len(shape) == 1:
            return jnp.ones(shape, jnp.float32)
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2]))

    return jax.tree.map(init, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def decode_inputs(config: ModelConfig, batch: int, context: int):
    """A decode step: `batch` sequences with `context` cached tokens each, one new token."""
    per_seq = -(-(context + 1) // BLOCK)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch)]
    positions, metadata = build_metadata(tables, [context] * batch, [1] * batch, BLOCK)
    pool = init_kv_pool(config.num_layers, 1 + batch * per_seq, BLOCK, config.num_kv_heads,
                        config.head_dim)
    tokens = jnp.asarray(np.random.default_rng(batch).integers(0, config.vocab_size, batch),
                         jnp.int32)
    return tokens, positions, pool, metadata


def time_step(model, params, inputs, iters: int) -> tuple[float, float]:
    """(seconds per step of the compiled forward after one warm-up call, the GFLOPs XLA's
    cost analysis counts in it)."""
    step = jax.jit(type(model).forward, static_argnums=0).lower(model, params, *inputs).compile()
    jax.block_until_ready(step(params, *inputs))
    start = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(step(params, *inputs))
    return (time.perf_counter() - start) / iters, step.cost_analysis()["flops"] / 1e9


def expert_gflops(config: ModelConfig, rows: int) -> float:
    """GFLOPs of `rows` (token, expert) MLP evaluations over all layers (gate, up, down)."""
    per_pair = 2 * 3 * config.hidden_size * config.moe_intermediate_size
    return rows * config.num_layers * per_pair / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=192)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    config = make_config(args)
    params = random_params(config)
    e, k = config.num_experts, config.num_experts_per_tok
    print(f"Qwen3-MoE-shaped: hidden {config.hidden_size}, {config.num_layers} layers, {e} "
          f"experts, top-{k}, expert width {config.moe_intermediate_size}, "
          f"{config.num_params / 1e6:.1f}M params, float32; decode steps at context "
          f"{args.context}, {args.iters} iterations")
    print(f"{'':>51}{'expert GFLOP':^36}{'XLA step GFLOP':^22}")
    print(f"{'tokens':>6}{'grouped ms':>12}{'dense ms':>10}{'tiled ms':>10}{'dense/grouped':>15}"
          f"{'routed':>12}{'all':>12}{'bound E/k':>12}{'grouped':>11}{'dense':>11}")
    for batch in (int(b) for b in args.batches.split(",")):
        inputs = decode_inputs(config, batch, args.context)
        grouped, grouped_flops = time_step(MoeModel(config, expert_fn=grouped_experts), params,
                                           inputs, args.iters)
        dense, dense_flops = time_step(MoeModel(config, expert_fn=dense_experts), params,
                                       inputs, args.iters)
        tiled, _ = time_step(MoeModel(config, expert_fn=tiled_experts), params, inputs,
                             args.iters)
        print(f"{batch:>6}{grouped * 1e3:>12.1f}{dense * 1e3:>10.1f}{tiled * 1e3:>10.1f}"
              f"{dense / grouped:>15.2f}"
              f"{expert_gflops(config, batch * k):>12.4g}{expert_gflops(config, batch * e):>12.4g}"
              f"{e / k:>12.1f}{grouped_flops:>11.4g}{dense_flops:>11.4g}", flush=True)


if __name__ == "__main__":
    main()
