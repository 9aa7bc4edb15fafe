"""Greedy chat answers of the default model in bfloat16 against float32, token by token.

    python scripts/check_bf16_greedy.py [--max-tokens 64]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    for row in compare(args.max_tokens):
        where = ("identical" if row["first_divergence"] is None else
                 f"first divergence at token {row['first_divergence']}, top-2 margin float32 "
                 f"{row.get('margin_float32', float('nan')):.4f} / bfloat16 "
                 f"{row.get('margin_bfloat16', float('nan')):.4f}")
        print(f"{row['prompt']!r}: {row['tokens']} tokens, {where}")


if __name__ == "__main__":
    main()
