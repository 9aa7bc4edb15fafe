"""Where a small CPU decode step's forward spends its time, by removing its parts.

Lab probe (docs/cpu_decode_history.md, 2026-12-07). The runner's forward of a decode step
(the default model, context 128), with a greedy draw fed to the next step, is chained on the
device (--steps calls a round, --rounds rounds, the median round): whole; without the LM head
(the logits replaced by a slice of the final hidden state); without the head and with every
layer but the first replaced by nothing; with no layer and no head (what the dispatch of the
step's arrays, the embedding and rope cost); and with the head but no layer. Differences give
the head's time and a layer's (against its weights' bytes: the rate it streams them at).
`--quantization int8 --quantize-lm-head` runs the int8 model.

    python scripts/lab/forward_parts.py --dtype bfloat16
    python scripts/lab/forward_parts.py --dtype bfloat16 --quantization int8 --quantize-lm-head
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import decode_seqs, forward_args, make_llm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpage import layers
    from jaxpage.engine.runner import _forward_fn

    kwargs = {"quantization": args.quantization} if args.quantization else {}
    if args.quantize_lm_head:
        kwargs["quantize_lm_head"] = True
    llm = make_llm(max(8, args.batch), dtype=args.dtype, **kwargs)
    runner = llm.engine.runner
    model, platform, params, _, token_ids, positions, attn_md = forward_args(
        runner, decode_seqs(runner, args.batch, 128))
    model_type, fused_layer = type(model), layers.decoder_layer
    whole_logits = model_type.compute_logits

    def chained_ms() -> float:
        def run(params, pool, token_ids, positions, attn_md):
            logits, pool = _forward_fn(model, platform, params, pool, token_ids, positions,
                                       attn_md)
            vocab = logits.shape[-1]
            return jnp.argmax(logits, axis=-1).astype(jnp.int32) % vocab, pool

        call = jax.jit(run, donate_argnums=1)
        ids = token_ids
        for _ in range(3):
            ids, runner.kv_pool = call(params, runner.kv_pool, ids, positions, attn_md)
        jax.block_until_ready(ids)
        rounds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                ids, runner.kv_pool = call(params, runner.kv_pool, ids, positions, attn_md)
            jax.block_until_ready(ids)
            rounds.append((time.perf_counter() - start) / args.steps)
        return float(np.median(rounds)) * 1e3

    def no_head(self, params, hidden, live_rows=None):
        return hidden[:, :8].astype(jnp.float32)

    calls = [0]

    def first_layer_only(x, h, layer, cos, sin, layer_kv, metadata, next_norm, **kw):
        calls[0] += 1
        if calls[0] % model.config.num_layers == 1:
            return fused_layer(x, h, layer, cos, sin, layer_kv, metadata, next_norm, **kw)
        return x, h, layer_kv

    def no_layer(x, h, layer, cos, sin, layer_kv, metadata, next_norm, **kw):
        return x, h, layer_kv

    times = {}
    try:
        times["whole"] = chained_ms()
        model_type.compute_logits = no_head
        times["no head"] = chained_ms()
        layers.decoder_layer = first_layer_only
        times["no head, one layer"] = chained_ms()
        layers.decoder_layer = no_layer
        times["no head, no layer"] = chained_ms()
        model_type.compute_logits = whole_logits
        times["head, no layer"] = chained_ms()
    finally:
        model_type.compute_logits, layers.decoder_layer = whole_logits, fused_layer
    for name, ms in times.items():
        print(f"{name:<22}{ms:8.3f} ms a step")
    layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params["layers"][0]))
    layer_ms = (times["no head"] - times["no head, no layer"]) / model.config.num_layers
    print(f"a layer {layer_ms * 1e3:.0f} us ({layer_bytes / 1e6:.2f} MB of weights: "
          f"{layer_bytes / layer_ms / 1e6:.1f} GB/s), the head "
          f"{times['whole'] - times['no head']:.3f} ms, the rest "
          f"{times['no head, no layer']:.3f} ms")


if __name__ == "__main__":
    main()
