"""Incremental detokenization and stop-string matching for one sequence (no JAX).

Decoding only a short window of recent tokens each step keeps the cost per token constant;
a window that ends in the middle of a multi-byte character (decoded as U+FFFD) waits for
the next token. A few prompt tokens seed the window so tokenizers that drop a leading space
at the start of a decode (SentencePiece) still get word boundaries right. Where the tokenizer
is a transformers fast tokenizer whose decode is its Rust tokenizer's, the window lives in
Rust (`tokenizers.decoders.DecodeStream`, as vLLM's fast detokenizer does): one call a token,
0.8 us against 2.1 for the two decodes of the window (SmolLM2's tokenizer), seeded with the
same prompt tokens. Where that Rust tokenizer is a byte-level BPE (GPT-2's byte alphabet:
SmolLM2, Llama 3, Qwen, Mistral's newer tokenizers), a token's text is a fixed string of bytes,
so the window is a table of each token's bytes, checked against the tokenizer's own decode of
every token when it is built, and of the text of those that are whole characters: only the
bytes of a character split between tokens go through a UTF-8 decoder.
"""

from __future__ import annotations

import codecs
import functools
import weakref
from collections.abc import Sequence
from typing import Any

try:
    from tokenizers.decoders import ByteLevel, DecodeStream
except ImportError:  # pragma: no cover - a tokenizers older than 0.21: the window in Python
    ByteLevel = DecodeStream = None

_UTF8 = codecs.getincrementaldecoder("utf-8")

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
        # each token's bytes, where its text is that (`token_bytes`); None elsewhere; and the
        # text of those that are whole characters (None for a token ending inside one)
        self.token_bytes, self.token_texts = (None, None) if self.backend is None else (
            _token_tables(self.backend))
        self._one: dict[int, str] = {}

    def one(self, token: int) -> str:
        text = self._one.get(token)
        if text is None:
            text = self._one[token] = self.decode([token])
        return text


# `_token_tables` by Rust tokenizer: the engines of data-parallel replicas share theirs
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_tables(backend: Any) -> tuple[list[bytes] | None, list[str | None] | None]:
    """(`token_bytes(backend)`, the text of each token whose bytes are whole characters),
    made once a tokenizer (again if tokens were added to it since)."""
    size = backend.get_vocab_size(with_added_tokens=True)
    cached = _TABLES.get(backend)
    if cached is None or cached[0] != size:
        table = token_bytes(backend)
        texts = None if table is None else [_whole_text(data) for data in table]
        cached = _TABLES[backend] = (size, table, texts)
    return cached[1], cached[2]


def token_bytes(backend: Any) -> list[bytes] | None:
    """Each token's bytes (b"" for special tokens and unused ids) where `backend`, a Rust
    tokenizer, decodes as a byte-level BPE: each token's characters mapped back through
    GPT-2's byte alphabet (one holding another character: its UTF-8, as the Rust decoder
    does), the whole decode the UTF-8 of the tokens' bytes joined, invalid bytes replaced.
    None for any other decoder, or if one token's decode differs from its bytes' (the table
    is checked against the decode of every token: ~80 ms for a vocabulary of 49k)."""
    if ByteLevel is None or type(backend.decoder) is not ByteLevel:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    byte_of = _byte_alphabet()
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    table = []
    for i in range(size):
        piece = backend.id_to_token(i)
        if piece is None or i in special:
            table.append(b"")
            continue
        try:
            table.append(bytes([byte_of[c] for c in piece]))
        except KeyError:  # not in the byte alphabet (an added token): its own text
            table.append(piece.encode())
    decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    if any(text != data.decode("utf-8", "replace")
           for text, data in zip(decoded, table, strict=True)):
        return None
    return table


def _whole_text(data: bytes) -> str | None:
    """`data` as UTF-8, None unless it is whole characters."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: the printable bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


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
        # the window, seeded at the first update: a byte-level BPE's bytes (`_bytes_text`),
        # else the Rust window (`_stream_text`); where the decoder has no Rust tokenizer, the
        # two decodes of `_window_text`
        self._bytes = self.decoder.token_bytes
        self._pending = b""  # `_bytes_text`'s bytes of a character not whole yet
        self._held = ""  # and its text not shown yet (it ends inside a character)
        self._stream = None if self.decoder.backend is None or self._bytes is not None else (
            DecodeStream(skip_special_tokens=True))
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
        if self._bytes is not None:
            new_text = self._bytes_text(token_ids, final)
        elif self._stream is not None:
            new_text = self._stream_text(token_ids, final)
        else:
            new_text = self._window_text(token_ids, final)
        if new_text is None:
            return None
        if not (check_stop and self.stop):
            self.text += new_text
            return None
        search_from = max(len(self.text) - self.hold_back, 0)
        self.text += new_text
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

    def _bytes_text(self, token_ids: Sequence[int], final: bool) -> str | None:
        """`_window_text` for a byte-level BPE: the new tokens' bytes decoded as UTF-8 after
        those of a character not whole yet (the seed first: the window's prompt tokens,
        their text dropped); a token of whole characters after whole ones (most) is its text
        from the table. Text ending inside a character, or in a replaced byte, waits for the
        next token as the window's would, unless `final`: then the bytes still waiting show
        as U+FFFD."""
        table = self._bytes
        size = len(table)
        if self._stepped is None:
            self._decode(b"".join(table[t] if t < size else b""
                                  for t in token_ids[self.prefix_offset:self.read_offset]),
                         False)
            self._stepped = self.read_offset
        text = None
        if len(token_ids) - self._stepped == 1 and not self._pending:
            token = token_ids[-1]
            text = self.decoder.token_texts[token] if token < size else ""
        if text is None:
            text = self._decode(b"".join(table[t] if t < size else b""
                                         for t in token_ids[self._stepped:]), final)
        self._stepped = len(token_ids)
        text = self._held + text
        if not final and (self._pending or text.endswith("\ufffd")):
            self._held = text
            return None
        self._held = ""
        return text or None

    def _decode(self, data: bytes, final: bool) -> str:
        """The text of the waiting bytes and `data`, invalid bytes replaced (U+FFFD); bytes
        ending inside a character wait (`_pending`), unless `final`."""
        data = self._pending + data
        try:  # whole characters: the usual
            text, self._pending = data.decode("utf-8"), b""
            return text
        except UnicodeDecodeError:
            decoder = _UTF8("replace")
            text = decoder.decode(data, final)
            self._pending = decoder.getstate()[0]
            return text

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
