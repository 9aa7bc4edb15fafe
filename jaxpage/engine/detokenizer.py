"""Incremental detokenization and stop-string matching for one sequence (no JAX).

Decoding only a short window of recent tokens each step keeps the cost per token constant;
a window that ends in the middle of a multi-byte character (decoded as U+FFFD) waits for
the next token. A few prompt tokens seed the window so tokenizers that drop a leading space
at the start of a decode (SentencePiece) still get word boundaries right. Where the tokenizer
is a transformers fast tokenizer whose decode is its Rust tokenizer's, the window lives in
Rust (`tokenizers.decoders.DecodeStream`, as vLLM's fast detokenizer does): one call a token,
0.8 us against 2.1 for the two decodes of the window (SmolLM2's tokenizer), seeded with the
same prompt tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - a tokenizers older than 0.21: the window in Python
    DecodeStream = None

_CONTEXT_TOKENS = 5


class TextDecoder:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function of the ids.

    For a transformers fast tokenizer whose decode adds nothing to its Rust tokenizer's (no
    clean-up of spaces, no subclass overriding decode) it calls that Rust decode itself,
    skipping transformers' Python wrapper (three quarters of the cost of a short decode).
    `one(token)` is the text of a single token, remembered (at most the vocabulary's size of
    entries): in the steady state of incremental detokenizing one of the two decodes a
    token needs is of the previous token alone. One TextDecoder serves every sequence of a
    tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        own = all(getattr(getattr(type(tokenizer), name, None), "__module__", "").startswith(
            "transformers.tokenization_utils") for name in ("decode", "_decode"))
        if backend is None or not own or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                 True):
            self.decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
            self.backend = None
        else:
            self.decode = functools.partial(backend.decode, skip_special_tokens=True)
            # the Rust tokenizer an IncrementalDetokenizer streams through, where it can
            self.backend = backend if DecodeStream is not None else None
        self._one: dict[int, str] = {}

    def one(self, token: int) -> str:
        text = self._one.get(token)
        if text is None:
            text = self._one[token] = self.decode([token])
        return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_len: int, stop: Sequence[str] = (),
                 decoder: TextDecoder | None = None) -> None:
        self.tokenizer = tokenizer
        # made once per tokenizer by an engine that detokenizes many sequences
        self.decoder = decoder or TextDecoder(tokenizer)
        self.prefix_offset = max(prompt_len - _CONTEXT_TOKENS, 0)
        self.read_offset = prompt_len
        self.stop = tuple(stop)
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        # the Rust window (`_stream_text`), seeded at the first update; where the decoder
        # has no Rust tokenizer, the two decodes below
        self._stream = None if self.decoder.backend is None else DecodeStream(
            skip_special_tokens=True)
        self._stepped: int | None = None  # tokens stepped into it (None: not seeded yet)

    def update(self, token_ids: Sequence[int], check_stop: bool = True,
               final: bool = False) -> str | None:
        """Feed the sequence's tokens (prompt + output so far) after a new one was appended.

        Returns the stop string if one now appears in the text (the text is then cut just
        before it), else None. With check_stop False (min_tokens not reached yet) stop
        strings are not looked for, and text before this point is never searched again.
        Bytes that end in the middle of a character wait for the next token, unless `final`
        (no token will come): then they show as U+FFFD, as the tokenizer's decode shows them.
        """
        if self._stream is not None:
            new_text = self._stream_text(token_ids, final)
        else:
            new_text = self._window_text(token_ids, final)
        if new_text is None:
            return None
        search_from = max(len(self.text) - self.hold_back, 0)
        self.text += new_text
        if not (check_stop and self.stop):
            return None
        matches = [(at, stop) for stop in self.stop
                   if (at := self.text.find(stop, search_from)) >= 0]
        if not matches:
            return None
        at, stop = min(matches)
        self.text = self.text[:at]
        return stop

    def _window_text(self, token_ids: Sequence[int], final: bool) -> str | None:
        """The text the tokens since `read_offset` add, from two decodes of the window (the
        tokens from `prefix_offset` to `read_offset`, and on to the end); None while it ends
        inside a character (unless `final`) or adds nothing. Moves the window on."""
        decoder, start, read = self.decoder, self.prefix_offset, self.read_offset
        prefix = (decoder.one(token_ids[start]) if read - start == 1
                  else decoder.decode(token_ids[start:read]))
        full = decoder.decode(token_ids[start:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full[len(prefix):]

    def _stream_text(self, token_ids: Sequence[int], final: bool) -> str | None:
        """`_window_text` through the Rust window: each token since `read_offset` stepped
        once (the seed first: the window's prompt tokens, their text dropped). Bytes still
        waiting for the rest of their character at the `final` token show as the window's
        decode shows them (U+FFFD), by `_window_text` over what the stream has not shown."""
        stream, backend = self._stream, self.decoder.backend
        if self._stepped is None:
            for token in token_ids[self.prefix_offset:self.read_offset]:
                stream.step(backend, token)
            self._stepped = self.read_offset
        pieces = []
        for i in range(self._stepped, len(token_ids)):
            piece = stream.step(backend, token_ids[i])
            if piece is not None:
                pieces.append(piece)
                self.prefix_offset, self.read_offset = self.read_offset, i + 1
        self._stepped = len(token_ids)
        text = "".join(pieces)
        if final and self.read_offset < len(token_ids):
            # the stream holds the last tokens' bytes back: the window decodes them
            tail = self._window_text(token_ids, final=True)
            text += tail or ""
        return text or None

    def streamable_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a possible partial stop string."""
        if finished or not self.hold_back:
            return self.text
        return self.text[: max(len(self.text) - self.hold_back, 0)]
