"""Incremental detokenization and stop-string matching for one sequence (no JAX).

Decoding only a short window of recent tokens each step keeps the cost per token constant;
a window that ends in the middle of a multi-byte character (decoded as U+FFFD) waits for
the next token. A few prompt tokens seed the window so tokenizers that drop a leading space
at the start of a decode (SentencePiece) still get word boundaries right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_len: int, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = max(prompt_len - _CONTEXT_TOKENS, 0)
        self.read_offset = prompt_len
        self.stop = tuple(stop)
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, token_ids: Sequence[int], check_stop: bool = True,
               final: bool = False) -> str | None:
        """Feed the sequence's tokens (prompt + output so far) after a new one was appended.

        Returns the stop string if one now appears in the text (the text is then cut just
        before it), else None. With check_stop False (min_tokens not reached yet) stop
        strings are not looked for, and text before this point is never searched again.
        Bytes that end in the middle of a character wait for the next token, unless `final`
        (no token will come): then they show as U+FFFD, as the tokenizer's decode shows them.
        """
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
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
