"""IncrementalDetokenizer on its own, fed one token at a time, with a real byte-level BPE
tokenizer whose tokens split multi-byte UTF-8 characters (no engine, no JAX).

The oracle is the tokenizer's own decode of each prefix of the tokens. Each test runs over
the three windows a detokenizer may use: the byte-level BPE's token bytes, the Rust
tokenizer's DecodeStream, and two decodes a token in Python.
"""

from __future__ import annotations

import pytest
from conftest import byte_level_bpe_tokenizer

from jaxpage.engine.detokenizer import IncrementalDetokenizer, TextDecoder

REPLACEMENT = "\ufffd"  # what a decode shows for the bytes of an incomplete character

TEXT = "naïve café 日本語 😀 crêpes, déjà vu 😁 and a café in Zürich, 日本語 again."


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe_tokenizer()


@pytest.fixture(params=["bytes", "stream", "window"])
def detokenizer(tokenizer, request):
    """IncrementalDetokenizer(tokenizer, prompt_len, stop) through one of the windows."""
    decoder = TextDecoder(tokenizer)
    assert decoder.token_bytes is not None and decoder.backend is not None
    if request.param != "bytes":
        decoder.token_bytes = None
    if request.param == "window":
        decoder.backend = None

    def make(prompt_len, stop=()):
        detok = IncrementalDetokenizer(tokenizer, prompt_len, stop, decoder)
        assert (detok._bytes is not None, detok._stream is not None) == {
            "bytes": (True, False), "stream": (False, True), "window": (False, False)}[
                request.param]
        return detok
    return make


def prefix_decodes(tokenizer, token_ids) -> list[str]:
    """decode(token_ids[:k]) for k = 0..len(token_ids)."""
    return [tokenizer.decode(token_ids[:k], skip_special_tokens=True)
            for k in range(len(token_ids) + 1)]


def whole_character_texts(decodes: list[str]) -> list[str]:
    """The text a detokenizer can show after k tokens: the decode of the longest prefix of
    at most k tokens that does not end inside a character."""
    texts = [decodes[0]]
    for decoded in decodes[1:]:
        texts.append(texts[-1] if decoded.endswith(REPLACEMENT) else decoded)
    return texts


def split_character_stops(text: str, token_ids, tokenizer) -> list[tuple[str, int]]:
    """(stop, position) pairs: for each token that ends inside a multi-byte character, the
    text from the last character already decoded before that token through the split
    character. Each stop so starts in text one update produced and ends in a later one;
    only stops whose first occurrence in `text` is that one are kept."""
    decodes = prefix_decodes(tokenizer, token_ids)
    shown = whole_character_texts(decodes)
    stops = []
    for k in range(1, len(token_ids)):
        if not decodes[k].endswith(REPLACEMENT) or not shown[k - 1]:
            continue
        split_at = len(decodes[k]) - 1  # the character whose first bytes end token k
        assert text[:split_at] == decodes[k][:split_at]
        assert len(text[split_at].encode()) > 1
        start = len(shown[k - 1]) - 1
        stop = text[start : split_at + 1]
        if text.find(stop) == start:
            stops.append((stop, start))
    return stops


def test_tokens_split_multibyte_characters(tokenizer):
    """The premise of the other tests: some tokens hold only part of a character."""
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT and REPLACEMENT not in TEXT
    alone = [tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT in piece for piece in alone), alone
    assert any(d.endswith(REPLACEMENT) for d in prefix_decodes(tokenizer, ids))
    assert len(split_character_stops(TEXT, ids, tokenizer)) >= 3


@pytest.mark.parametrize("prompt", ["", "Q: ", "日本語と😀: "])
def test_streamed_text_is_whole_characters_and_ends_as_the_decode(detokenizer, tokenizer, prompt):
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(TEXT)
    expected = whole_character_texts(prefix_decodes(tokenizer, output_ids))
    detok = detokenizer(len(prompt_ids))
    waited = False
    for k in range(1, len(output_ids) + 1):
        before = detok.text
        assert detok.update(prompt_ids + output_ids[:k]) is None
        assert REPLACEMENT not in detok.text
        assert detok.text == expected[k]
        assert detok.streamable_text(finished=False) == detok.text  # no stop: nothing held
        waited |= detok.text == before
    assert waited, "no token ended inside a character"
    assert detok.text == tokenizer.decode(output_ids) == TEXT


def test_a_sequence_that_ends_inside_a_character_shows_its_bytes_as_the_decode_does(
        detokenizer, tokenizer):
    """Output cut in the middle of a character (max_tokens reached there): while running the
    bytes wait for the next token; on the last token (`final`) the text is the decode's."""
    ids = tokenizer.encode(TEXT)
    cut = next(k for k, d in enumerate(prefix_decodes(tokenizer, ids)) if d.endswith(REPLACEMENT))
    detok, waiting = detokenizer(0), detokenizer(0)
    for k in range(1, cut):
        detok.update(ids[:k])
        waiting.update(ids[:k])
    assert waiting.update(ids[:cut]) is None
    assert REPLACEMENT not in waiting.text  # not final: waits for the rest of the character
    assert waiting.text == detok.text
    detok.update(ids[:cut], final=True)
    assert detok.text == tokenizer.decode(ids[:cut]) and detok.text.endswith(REPLACEMENT)


def test_stop_string_with_a_split_multibyte_character_is_cut_exactly_before_it(
        detokenizer, tokenizer):
    ids = tokenizer.encode(TEXT)
    shown = whole_character_texts(prefix_decodes(tokenizer, ids))
    stops = split_character_stops(TEXT, ids, tokenizer)
    assert stops
    for stop, at in stops:
        assert any(len(c.encode()) > 1 for c in stop)
        found_at = next(k for k in range(len(ids) + 1) if stop in shown[k])
        detok = detokenizer(0, [stop, "never appears"])
        for k in range(1, found_at):
            assert detok.update(ids[:k]) is None, (stop, k)
        assert len(detok.text) > at, "the stop does not start in text shown before it ends"
        assert detok.update(ids[:found_at]) == stop
        assert detok.text == TEXT[:at]
        assert detok.streamable_text(finished=True) == TEXT[:at]


def test_the_earliest_stop_string_in_the_text_wins(detokenizer, tokenizer):
    """Two stops complete in the same update (the token after a split "ï"): the one that
    starts first in the text wins, whatever the order of the list."""
    ids = tokenizer.encode(TEXT)
    shown = whole_character_texts(prefix_decodes(tokenizer, ids))
    detok = detokenizer(0, ["ve", "aï"])
    k = 1
    while (found := detok.update(ids[:k])) is None:
        k += 1
    assert found == "aï" and detok.text == TEXT[: TEXT.index("aï")]
    assert "ve" in shown[k] and "ve" not in shown[k - 1] and "aï" not in shown[k - 1]


def test_streamable_text_holds_back_a_possible_partial_stop(detokenizer, tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, at = split_character_stops(TEXT, ids, tokenizer)[0]
    detok = detokenizer(0, [stop])
    cut = TEXT[:at]
    held_partial = False
    for k in range(1, len(ids) + 1):
        found = detok.update(ids[:k])
        if found is not None:
            break
        shown = detok.streamable_text(finished=False)
        # never shows text that the stop will remove, and holds back at most len(stop) - 1
        assert cut.startswith(shown), (k, shown)
        assert len(shown) >= len(detok.text) - (len(stop) - 1)
        if len(detok.text) > at:  # the text ends in a partial stop string...
            held_partial = True
            assert stop.startswith(detok.text[at:])
            assert len(shown) <= at  # ...which is not shown
        assert detok.streamable_text(finished=True) == detok.text
    assert found == stop and held_partial
    assert detok.text == cut == detok.streamable_text(finished=True)


def test_stop_strings_are_searched_only_in_text_after_check_stop_starts(
        detokenizer, tokenizer):
    """The engine passes check_stop=False until min_tokens tokens exist: an occurrence
    complete in the text of the tokens before that is never found, the next one is."""
    ids = tokenizer.encode(TEXT)
    shown = whole_character_texts(prefix_decodes(tokenizer, ids))
    stop = " 日本語"
    first, second = TEXT.find(stop), TEXT.find(stop, TEXT.find(stop) + 1)
    assert 0 <= first < second
    first_done = next(k for k in range(len(ids) + 1) if stop in shown[k])
    second_done = next(k for k in range(len(ids) + 1) if len(shown[k]) >= second + len(stop))

    # checking from the token that completes the first occurrence finds it
    detok = detokenizer(0, [stop])
    found = [detok.update(ids[:k], check_stop=k >= first_done) for k in range(1, first_done + 1)]
    assert found == [None] * (first_done - 1) + [stop] and detok.text == TEXT[:first]

    # checking from the token after: the first occurrence is past, the second one stops
    detok = detokenizer(0, [stop])
    for k in range(1, second_done):
        assert detok.update(ids[:k], check_stop=k > first_done) is None, k
    assert detok.update(ids[:second_done], check_stop=True) == stop
    assert detok.text == TEXT[:second]


def test_text_decoder_is_the_tokenizers_decode(tokenizer):
    """TextDecoder calls the Rust tokenizer itself only where transformers' decode adds
    nothing to it: for the plain fast tokenizer every window of the text's tokens (special
    ones among them) decodes as `tokenizer.decode(..., skip_special_tokens=True)` does, and
    `one(t)` is decode([t]). A tokenizer that cleans up spaces, a subclass overriding decode
    and an object with only a decode method keep their own decode."""
    import copy

    from jaxpage.engine.detokenizer import TextDecoder

    ids = tokenizer.encode(TEXT)
    ids[5:5] = [tokenizer.eos_token_id or 0]
    fast = TextDecoder(tokenizer)
    assert fast.decode.func == tokenizer.backend_tokenizer.decode
    for i in range(0, len(ids), 3):
        for j in range(i, min(i + 6, len(ids)) + 1):
            assert fast.decode(ids[i:j]) == tokenizer.decode(ids[i:j], skip_special_tokens=True)
    assert all(fast.one(t) == tokenizer.decode([t], skip_special_tokens=True) for t in ids)

    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    shouting = copy.deepcopy(tokenizer)
    shouting.__class__ = Shouting

    class Plain:
        def decode(self, token_ids, skip_special_tokens=False):
            return "-".join(map(str, token_ids))

    for other in (cleaning, shouting, Plain()):
        assert TextDecoder(other).decode.func == other.decode
    assert TextDecoder(shouting).decode(ids[:8]) == tokenizer.decode(
        ids[:8], skip_special_tokens=True).upper()
    assert TextDecoder(Plain()).one(7) == "7"


def test_token_bytes_decode_as_the_tokenizer_does(tokenizer):
    """The byte-level table: any run of tokens (special ones, ids past the vocabulary and an
    added token outside GPT-2's byte alphabet among them) joined as bytes and decoded with
    replacement is the tokenizer's decode, skipping special tokens; a tokenizer of another
    decoder gets no table."""
    import copy

    import numpy as np
    from tokenizers import decoders

    from jaxpage.engine.detokenizer import token_bytes

    added = copy.deepcopy(tokenizer)
    added.add_tokens(["<tool call>", "größe"])  # a space and non-ASCII: not byte characters
    backend = added.backend_tokenizer
    table = token_bytes(backend)
    assert table is not None and len(table) == len(added)
    assert table[len(tokenizer)] == b"<tool call>" and table[1] == b""  # <s>: special

    rng = np.random.default_rng(0)
    runs = [added.encode(TEXT), added.encode("a <tool call> größe é"),
            *(rng.integers(0, len(added) + 5, 12).tolist() for _ in range(200))]
    for ids in runs:
        joined = b"".join(table[i] if i < len(table) else b"" for i in ids)
        assert joined.decode("utf-8", "replace") == backend.decode(ids, skip_special_tokens=True)
    assert any(REPLACEMENT in backend.decode(ids) for ids in runs)

    other = copy.deepcopy(tokenizer)
    other.backend_tokenizer.decoder = decoders.Metaspace()
    assert token_bytes(other.backend_tokenizer) is None


def test_any_tokens_end_as_the_decode_of_them(detokenizer, tokenizer):
    """Token runs a random model may draw (bytes that are no UTF-8: a character's first bytes
    followed by another's, lone continuation bytes, special tokens), fed one at a time: the
    text at the last (`final`) token is the tokenizer's decode of them all, and the text
    shown before grows only by whole characters."""
    import numpy as np

    rng = np.random.default_rng(1)
    split = [t for t in range(len(tokenizer)) if REPLACEMENT in tokenizer.decode([t])]
    assert len(split) >= 10
    for _ in range(60):
        ids = [int(t) for t in rng.choice(split + list(range(len(tokenizer))), 16)]
        detok = detokenizer(0)
        for k in range(1, len(ids)):
            before = detok.text
            detok.update(ids[:k])
            assert detok.text.startswith(before)
        detok.update(ids, final=True)
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True), ids
