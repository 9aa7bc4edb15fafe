"""Stop strings through the engine's incremental detokenization, with a real byte-level BPE
tokenizer (its tokens split multi-byte characters) and a tiny random model of its vocab.

Every expectation comes from a first greedy run without stop strings, read through the
tokenizer's own decode of each prefix of its output tokens. A random model's output is
whatever it is, so each test takes the first of a fixed list of prompts whose first run has
what the test needs, and fails if none has.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from conftest import CORPUS, byte_bpe_llm
from test_detokenizer import REPLACEMENT

from jaxpage import SamplingParams

MAX_TOKENS = 24
_WORDS = sorted({word for line in CORPUS for word in line.split()})
PROMPTS = [" ".join(random.Random(seed).sample(_WORDS, 3)) for seed in range(50)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return byte_bpe_llm(tmp_path_factory.mktemp("llama_byte_bpe"), block_size=4, num_blocks=64,
                        max_num_batched_tokens=64, max_num_seqs=4)


def params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kwargs)


def greedy(llm, prompt, **kwargs):
    return llm.generate([prompt], params(**kwargs), use_tqdm=False)[0].outputs[0]


@dataclass
class FirstRun:
    """A greedy run without stop strings and the tokenizer's decode of its output."""

    prompt: str
    token_ids: list[int]
    engine_text: str
    decodes: list[str]  # [k]: decode(prompt ids + first k output ids) less the prompt

    @property
    def text(self) -> str:
        return self.decodes[-1]

    def whole(self, k: int) -> bool:
        """The first k output tokens end on a character boundary."""
        return not self.decodes[k].endswith(REPLACEMENT)

    def shown(self, k: int) -> str:
        """The text of the first k tokens up to the last whole character: what a stream
        can show after k tokens."""
        while not self.whole(k):
            k -= 1
        return self.decodes[k]

    def shortest_prefix_containing(self, stop: str) -> int:
        return next(k for k, text in enumerate(self.decodes) if stop in text)


@pytest.fixture(scope="module")
def first_run(llm):
    runs: dict[str, FirstRun] = {}

    def run(prompt: str) -> FirstRun:
        if prompt not in runs:
            out = llm.generate([prompt], params(), use_tqdm=False)[0]
            tokenizer = llm.tokenizer
            prompt_ids = list(out.prompt_token_ids)
            assert prompt_ids == tokenizer.encode(prompt)
            assert tokenizer.decode(prompt_ids) == prompt
            ids = list(out.outputs[0].token_ids)
            assert len(ids) == MAX_TOKENS
            decodes = []
            for k in range(len(ids) + 1):
                whole = tokenizer.decode(prompt_ids + ids[:k], skip_special_tokens=True)
                assert whole.startswith(prompt)
                decodes.append(whole[len(prompt):])
            runs[prompt] = FirstRun(prompt, ids, out.outputs[0].text, decodes)
        return runs[prompt]

    return run


def first_with(first_run, what: str, find):
    """The first prompt's first run in which `find(run)` finds something, and that thing."""
    for prompt in PROMPTS:
        run = first_run(prompt)
        found = find(run)
        if found is not None:
            return run, found
    pytest.fail(f"none of the {len(PROMPTS)} prompts' greedy outputs has {what}")


def occurrences(text: str, stop: str) -> list[int]:
    found, at = [], text.find(stop)
    while at >= 0:
        found.append(at)
        at = text.find(stop, at + 1)
    return found


def split_character(run: FirstRun) -> int | None:
    """k where output token k ends inside a non-ASCII character that token k + 1 completes,
    in an output that ends on a character boundary."""
    if not run.whole(len(run.token_ids)):
        return None
    for k in range(1, len(run.token_ids)):
        cut, after = run.decodes[k], run.decodes[k + 1]
        if cut.endswith(REPLACEMENT) and run.whole(k + 1) and after[: len(cut) - 1] == cut[:-1]:
            char = after[len(cut) - 1]
            if char != REPLACEMENT and not char.isascii():
                return k
    return None


def spanning_stop(run: FirstRun) -> tuple[int, str] | None:
    """(at, stop): a stop string that starts inside one output token's text and ends inside
    the next one's, first occurring there; one with a non-ASCII character if there is."""
    found = []
    for i in range(1, len(run.token_ids)):
        if not all(run.whole(k) for k in (i - 1, i, i + 1)):
            continue
        start, middle, end = (len(run.decodes[k]) for k in (i - 1, i, i + 1))
        if middle - start < 2 or end - middle < 2:
            continue
        stop = run.text[start + 1 : end - 1]
        if REPLACEMENT not in stop and run.text.find(stop) == start + 1:
            found.append((stop.isascii(), stop.isspace(), start + 1, stop))
    return min(found)[2:] if found else None


def split_character_stop(run: FirstRun) -> tuple[int, str] | None:
    """(at, stop): a stop string from the last character shown before an output token that
    ends inside a non-ASCII character, through that character (the next token completes
    it), first occurring there."""
    for k in range(1, len(run.token_ids)):
        before, cut, after = run.shown(k - 1), run.decodes[k], run.decodes[k + 1]
        if not (before and cut.endswith(REPLACEMENT) and run.whole(k + 1)):
            continue
        split_at = len(cut) - 1
        if after[:split_at] != cut[:-1] or after[split_at] == REPLACEMENT:
            continue
        stop = after[len(before) - 1 : split_at + 1]
        if (not after[split_at].isascii() and REPLACEMENT not in stop
                and run.text.find(stop) == len(before) - 1):
            return len(before) - 1, stop
    return None


STOP_FINDERS = {"across-tokens": spanning_stop, "split-character": split_character_stop}


def deferred_stop(run: FirstRun) -> tuple[str, int, int] | None:
    """(stop, min_tokens, at): a stop string whose first occurrence is complete in the text
    of the first min_tokens - 1 tokens and which occurs again, ending after that text."""
    text, n = run.text, len(run.token_ids)
    for length in (4, 3, 2):
        for start in range(len(text) - length + 1):
            stop = text[start : start + length]
            if REPLACEMENT in stop or text.find(stop) != start:
                continue
            done = run.shortest_prefix_containing(stop)
            if done >= n or not run.whole(done):
                continue
            before = len(run.decodes[done])
            later = [at for at in occurrences(text, stop)
                     if before < at + length <= len(run.shown(n))]
            if later:
                return stop, done + 1, later[0]
    return None


def test_text_is_the_decoded_continuation(first_run):
    """Also across a character whose bytes are split between two tokens."""
    run, k = first_with(first_run, "a non-ASCII character split between two tokens",
                        split_character)
    assert run.engine_text == run.text  # decode(prompt + output) less the prompt
    assert not run.text[len(run.decodes[k]) - 1].isascii()


def test_text_of_an_output_ending_inside_a_character_is_the_decode(first_run):
    """max_tokens cut the output inside a character (or on a stray continuation byte): the
    last token's bytes no longer wait for a next token and show as the decode shows them."""
    run, _ = first_with(first_run, "an output ending inside a character",
                        lambda r: True if r.text.endswith(REPLACEMENT) else None)
    assert run.engine_text == run.text


@pytest.mark.parametrize("kind", STOP_FINDERS)
def test_stop_string_spanning_tokens_ends_generation_and_is_cut(llm, first_run, kind):
    run, (at, stop) = first_with(first_run, f"a stop string ({kind})", STOP_FINDERS[kind])
    out = greedy(llm, run.prompt, stop=[stop, "never appears"])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == run.text[:at] and stop not in out.text
    assert out.token_ids == run.token_ids[: run.shortest_prefix_containing(stop)]


@pytest.mark.parametrize("kind", STOP_FINDERS)
def test_streamed_deltas_add_up_and_never_show_a_stop_string_prefix(llm, first_run, kind):
    run, (at, stop) = first_with(first_run, f"a stop string ({kind})", STOP_FINDERS[kind])
    engine = llm.engine
    engine.add_request("stream", run.prompt, params(stop=[stop]))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "stream"
            (delta,) = out.outputs
            deltas.append((delta.text, list(delta.token_ids), out.finished))
    assert "".join(text for text, _, _ in deltas) == run.text[:at]
    assert sum((ids for _, ids, _ in deltas), []) == run.token_ids[
        : run.shortest_prefix_containing(stop)]
    assert [done for _, _, done in deltas] == [False] * (len(deltas) - 1) + [True]
    streamed, num_tokens, held_partial = "", 0, False
    for text, ids, done in deltas:
        streamed += text
        num_tokens += len(ids)
        assert run.text[:at].startswith(streamed)  # nothing that the stop string removes
        if not done:
            shown = run.shown(num_tokens)
            # at most a possible partial stop string is held back
            assert len(streamed) >= len(shown) - (len(stop) - 1)
            held_partial |= len(shown) > at
    assert held_partial  # the text did end in a partial stop string, which was not shown


def test_min_tokens_defers_stop_strings(llm, first_run):
    run, (stop, min_tokens, at) = first_with(
        first_run, "a stop string that occurs again after the tokens it is complete in",
        deferred_stop)
    first = run.text.find(stop)
    # the first min_tokens - 1 tokens hold the first occurrence: checked from there, it stops
    out = greedy(llm, run.prompt, stop=[stop], min_tokens=min_tokens - 1)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert (out.text, out.token_ids) == (run.text[:first], run.token_ids[: min_tokens - 1])

    # checked from token min_tokens on, the detokenizer looks for the stop string only where
    # it ends after the text of the first min_tokens - 1 tokens: the next such occurrence
    out = greedy(llm, run.prompt, stop=[stop], min_tokens=min_tokens)
    end = next(k for k in range(len(run.token_ids) + 1)
               if len(run.shown(k)) >= at + len(stop))
    assert end >= min_tokens
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == run.text[:at]
    assert out.token_ids == run.token_ids[:end]
