"""Incremental detokenization and stop-string matching for one sequence (no JAX).

Decoding only a short window of recent tokens each step keeps the cost per token constant;
a window that ends in the middle of a multi-byte character (decoded as U+FFFD) waits for
the next token. A few prompt tokens seed the window so tokenizers that drop a leading space
at the start of a decode (SentencePiece) still get word boundaries right.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

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
        else:
            self.decode = functools.partial(backend.decode, skip_special_tokens=True)
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

    def update(self, token_ids: Sequence[int], check_stop: bool = True,
               final: bool = False) -> str | None:
        """Feed the sequence's tokens (prompt + output so far) after a new one was appended.

        Returns the stop string if one now appears in the text (the text is then cut just
        before it), else None. With check_stop False (min_tokens not reached yet) stop
        strings are not looked for, and text before this point is never searched again.
        Bytes that end in the middle of a character wait for the next token, unless `final`
        (no token will come): then they show as U+FFFD, as the tokenizer's decode shows them.
        """
        decoder, start, read = self.decoder, self.prefix_offset, self.read_offset
        prefix = (decoder.one(token_ids[start]) if read - start == 1
                  else decoder.decode(token_ids[start:read]))
        full = decoder.decode(token_ids[start:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return None
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        search_from = max(len(self.text) - self.hold_back, 0)
        self.text += new_text
        if not check_stop:
            return None
        matches = [(at, stop) for stop in self.stop
                   if (at := self.text.find(stop, search_from)) >= 0]
        if not matches:
            return None
        at, stop = min(matches)
        self.text = self.text[:at]
        return stop

    def streamable_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a possible partial stop string."""
        if finished or not self.hold_back:
            return self.text
        return self.text[: max(len(self.text) - self.hold_back, 0)]
