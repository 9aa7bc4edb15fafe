"""Greedy chat answers of the default model in bfloat16 against float32, token by token.

    python scripts/check_bf16_greedy.py [--max-tokens 64]
    python scripts/check_bf16_greedy.py --logit-error HF_DIR   # how far bfloat16 errs

For each chat prompt: the tokens both dtypes agree on, and at the first divergence (if any)
float32's top-2 log-prob margin there and bfloat16's: a divergence is explained when the
two candidates were near-tied (a margin within bfloat16's rounding of the logits), not when
bfloat16 overturned a clear winner. tests/test_bf16_greedy.py asserts the same.
"""

from __future__ import annotations

import argparse

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for staying healthy.",
    "Explain what a neural network is in two sentences.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
]


def margin(logprobs_at) -> float:
    """Top-1 minus top-2 log-prob at one position ({token: Logprob or float})."""
    values = sorted((getattr(v, "logprob", v) for v in logprobs_at.values()), reverse=True)
    return values[0] - values[1]


def compare(max_tokens: int = 64, prompts=PROMPTS) -> list[dict]:
    from jaxpage import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, max_num_seqs=len(prompts))
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        runs[dtype] = [o.outputs[0] for o in llm.chat(conversations, params, use_tqdm=False)]
        del llm
    rows = []
    for prompt, a, b in zip(prompts, runs["float32"], runs["bfloat16"], strict=True):
        n = min(len(a.token_ids), len(b.token_ids))
        first = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), None)
        if first is None and len(a.token_ids) != len(b.token_ids):
            first = n  # one stopped (EOS) where the other went on
        row = {"prompt": prompt, "tokens": len(a.token_ids), "first_divergence": first,
               "text": a.text}
        if first is not None and first < len(a.logprobs) and first < len(b.logprobs):
            row["margin_float32"] = margin(a.logprobs[first])
            row["margin_bfloat16"] = margin(b.logprobs[first])
        rows.append(row)
    return rows


HELD_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Books became cheaper, literacy spread, and ideas travelled faster than ever before. "
    "def reverse(s):\n    return s[::-1]\n\nprint(reverse('hello world'))\n"
    "Three tips for staying healthy: sleep well, eat vegetables, and walk every day. "
    "Twelve times seven is eighty-four; the capital of France is Paris.")


def logit_errors(hf_dir: str, tokens: int = 160) -> dict[str, dict[str, float]]:
    """How far bfloat16 logits lie from HF transformers' float32 ones (the truth), teacher-forced
    on HELD_TEXT's first `tokens` tokens: HF's own bfloat16 and jaxpage's bfloat16 and float32
    (the model from `hf_dir`, an HF directory of the default model, one prefill step through the
    paged pool). Per implementation: mean and max |logit error|, and the share of positions
    whose argmax is the truth's."""
    import copy

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpage.attention import build_metadata, init_kv_pool
    from jaxpage.loading.hf import load_hf_dir
    from jaxpage.models.llama import LlamaModel

    ids = AutoTokenizer.from_pretrained(hf_dir)(HELD_TEXT)["input_ids"][:tokens]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        truth = hf(torch.tensor([ids])).logits[0].float().numpy()
        runs = {"HF bfloat16": copy.deepcopy(hf).to(torch.bfloat16)(
            torch.tensor([ids])).logits[0].float().numpy()}
    block = 16
    blocks = len(ids) // block + 2
    for dtype in ("float32", "bfloat16"):
        config, params = load_hf_dir(hf_dir, dtype)
        pool = jax.tree.map(lambda x, d=dtype: x.astype(d), init_kv_pool(
            config.num_layers, blocks, block, config.num_kv_heads, config.head_dim))
        positions, metadata = build_metadata([list(range(1, blocks))], [0], [len(ids)], block,
                                             logits_indices=list(range(len(ids))))
        logits, _ = jax.jit(LlamaModel.forward, static_argnums=0)(
            LlamaModel(config), params, jnp.asarray(ids, jnp.int32), positions, pool, metadata)
        runs[f"jaxpage {dtype}"] = np.asarray(logits)
    return {name: {"mean": float(np.abs(x - truth).mean()),
                   "max": float(np.abs(x - truth).max()),
                   "argmax": float((x.argmax(-1) == truth.argmax(-1)).mean())}
            for name, x in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logit-error", metavar="HF_DIR",
                        help="instead: bfloat16's logit error against HF's float32 on a held "
                             "text, HF's own and jaxpage's (HF_DIR: the default model as an HF "
                             "directory, e.g. the one scripts/peers/setup_vllm_cpu.sh writes)")
    args = parser.parse_args()
    if args.logit_error:
        for name, e in logit_errors(args.logit_error).items():
            print(f"{name:>18}: |logit error| mean {e['mean']:.4f}, max {e['max']:.3f}; "
                  f"argmax as float32's at {e['argmax']:.3f} of positions")
        return
    for row in compare(args.max_tokens):
        where = ("identical" if row["first_divergence"] is None else
                 f"first divergence at token {row['first_divergence']}, top-2 margin float32 "
                 f"{row.get('margin_float32', float('nan')):.4f} / bfloat16 "
                 f"{row.get('margin_bfloat16', float('nan')):.4f}")
        print(f"{row['prompt']!r}: {row['tokens']} tokens, {where}")


if __name__ == "__main__":
    main()
