"""KV cache dtypes: what a pool holds per byte, and what quantizing it costs in accuracy.

    python scripts/bench_kv_cache.py [--model M] [--dtype float32] [--chunk 128]

Capacity: tokens a 1 GiB pool holds per kv_cache_dtype (from `kv_bytes_per_block`, scales
included) for the default model and Llama-3-8B's shape, and the ratio to float32.

Accuracy: the model reads a held text teacher-forced (prefill in chunks of `--chunk` tokens
through a paged pool of each dtype: every token's attention reads K/V back from the pool, so
the earlier chunks' quantized K/V shape every later logit, as in serving) and reports, against
the same model over a float32 pool: the mean and largest absolute difference of the log-prob
of each actual next token, and the share of positions whose argmax (the greedy token) agrees.
tests/engine/test_kv_cache_dtype.py bounds these numbers.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention import build_metadata, init_kv_pool, kv_bytes_per_block

KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")

# The held text: the opening of Darwin's "On the Origin of Species" (1859, public domain),
# prose the model was not tuned on by us and that the tests never generate.
HELD_TEXT = (
    "When on board H.M.S. 'Beagle,' as naturalist, I was much struck with certain facts in "
    "the distribution of the inhabitants of South America, and in the geological relations "
    "of the present to the past inhabitants of that continent. These facts seemed to me to "
    "throw some light on the origin of species--that mystery of mysteries, as it has been "
    "called by one of our greatest philosophers. On my return home, it occurred to me, in "
    "1837, that something might perhaps be made out on this question by patiently "
    "accumulating and reflecting on all sorts of facts which could possibly have any bearing "
    "on it. After five years' work I allowed myself to speculate on the subject, and drew up "
    "some short notes; these I enlarged in 1844 into a sketch of the conclusions, which then "
    "seemed to me probable: from that period to the present day I have steadily pursued the "
    "same object. I hope that I may be excused for entering on these personal details, as I "
    "give them to show that I have not been hasty in coming to a decision. My work is now "
    "nearly finished; but as it will take me two or three more years to complete it, and as "
    "my health is far from strong, I have been urged to publish this Abstract.")

SHAPES = {  # (num_layers, num_kv_heads, head_dim)
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3-8B": (32, 8, 128),
}


def tokens_per_gib(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                   block_size: int = 16) -> int:
    block = kv_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim,
                               jnp.dtype(kv_dtype))
    return (1 << 30) // block * block_size


def score_text(llm, token_ids: list[int], kv_dtype: str, *, chunk: int = 128,
               block_size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(log-prob of each actual next token [n - 1], argmax at each position [n - 1]) of the
    engine's model reading `token_ids` in chunks through a fresh pool of `kv_dtype`."""
    from jaxpage.engine.runner import _FORWARD

    runner = llm.engine.runner
    config = runner.model.config
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 1
    pool = init_kv_pool(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                        config.head_dim, jnp.dtype(kv_dtype))
    table = list(range(1, num_blocks))
    logprobs, argmax = [], []
    for start in range(0, n, chunk):
        new = min(chunk, n - start)
        positions, md = build_metadata([table], [start], [new], block_size,
                                       logits_indices=list(range(new)), backend="jnp")
        ids = jnp.asarray(token_ids[start:start + new], jnp.int32)
        logits, pool = _FORWARD(runner.model, None, runner.params, pool, ids,
                                jnp.asarray(positions),
                                jax.tree.map(jnp.asarray, md))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        logprobs.append(np.asarray(logp))
        argmax.append(np.asarray(jnp.argmax(logits, axis=-1)))
    logp = np.concatenate(logprobs)[:-1]
    targets = np.asarray(token_ids[1:])
    return logp[np.arange(n - 1), targets], np.concatenate(argmax)[:-1]


def accuracy(llm, token_ids: list[int], kv_dtypes=KV_DTYPES, chunk: int = 128) -> dict:
    """Per kv dtype: mean / max |log-prob difference| against float32 and argmax agreement."""
    base_lp, base_arg = score_text(llm, token_ids, "float32", chunk=chunk)
    rows = {}
    for kv_dtype in kv_dtypes:
        lp, arg = score_text(llm, token_ids, kv_dtype, chunk=chunk)
        diff = np.abs(lp - base_lp)
        rows[kv_dtype] = {"mean_abs_logprob_diff": float(diff.mean()),
                          "max_abs_logprob_diff": float(diff.max()),
                          "argmax_agreement": float((arg == base_arg).mean()),
                          "mean_logprob": float(lp.mean())}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--chunk", type=int, default=128)
    args = parser.parse_args()

    print("tokens a 1 GiB pool holds (block_size 16)")
    print(f"{'kv_cache_dtype':>15} " + " ".join(f"{name:>22}" for name in SHAPES))
    for kv_dtype in KV_DTYPES:
        cells = []
        for shape in SHAPES.values():
            tokens = tokens_per_gib(*shape, kv_dtype)
            cells.append(f"{tokens:>12,} ({tokens / tokens_per_gib(*shape, 'float32'):.2f}x)")
        print(f"{kv_dtype:>15} " + " ".join(f"{c:>22}" for c in cells))

    from jaxpage import LLM

    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(dtype=args.dtype, max_num_seqs=1, **kwargs)
    token_ids = llm.tokenizer.encode(HELD_TEXT)
    print(f"\nheld text: {len(token_ids)} tokens, model {args.dtype}, chunks of {args.chunk}; "
          "against the same model over a float32 pool")
    print(f"{'kv_cache_dtype':>15} {'mean |dlogp|':>13} {'max |dlogp|':>12} "
          f"{'argmax agree':>13} {'mean logp':>10}")
    for kv_dtype, row in accuracy(llm, token_ids, chunk=args.chunk).items():
        print(f"{kv_dtype:>15} {row['mean_abs_logprob_diff']:>13.5f} "
              f"{row['max_abs_logprob_diff']:>12.4f} {row['argmax_agreement']:>13.2%} "
              f"{row['mean_logprob']:>10.4f}")


if __name__ == "__main__":
    main()
