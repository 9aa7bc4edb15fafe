"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice or a grammar.

Host side, no JAX. A request's constraint (`StructuredOutputsParams`, vLLM's name and fields)
is compiled by llguidance into a grammar once per distinct constraint (`Grammars`, cached);
each constrained sequence holds its own `llguidance.LLMatcher`, which advances on every token
the sequence draws. Before each draw the runner fills the matcher's next-token bitmask (one
packed int32 row, bit t of word t // 32 set when token t may follow) while the device runs
the forward, and the sampler applies it on the device (`jaxpage.sampling`).

llguidance rather than xgrammar or outlines: it is a Rust wheel with no dependencies and a
NumPy interface (xgrammar needs torch, which jaxpage must never need), it compiles a schema
lazily in about a millisecond, and computes a mask over a 49k vocabulary in tens of
microseconds once warm.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpage.validation import check

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# JSON's whitespace between tokens, by default: any of JSON's four whitespace characters, up to
# 32 in a row. Unbounded (vLLM's default) lets a small model loop on newlines until max_tokens
# (SmolLM2-135M does, under 2 of 4 test schemas); 32 still holds pretty-printed JSON's newline
# and indentation 15 levels deep.
DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, exactly one of:

    json: a JSON schema (a dict, or its JSON text); regex: a regular expression the whole
    output matches (Rust regex syntax, as llguidance reads it); choice: a list of strings,
    the output being one of them; grammar: a context-free grammar in llguidance's Lark
    dialect, or GBNF/EBNF (`::=` rules, as llama.cpp writes them); json_object: True for any
    JSON object.
    disable_any_whitespace: JSON without whitespace between tokens (by default the grammar
    lets the model place whitespace where JSON allows it, as vLLM's llguidance backend does,
    but at most 32 characters in a row: `DEFAULT_WHITESPACE`); whitespace_pattern: a regex
    for the whitespace JSON may hold instead.
    """

    json: str | dict | None = dataclasses.field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        check(len(given) == 1, "structured_outputs", self,
              f"exactly one of {', '.join(KINDS)} (given: {', '.join(given) or 'none'})")
        if self.json is not None:
            check(isinstance(self.json, str | dict), "structured_outputs.json", self.json,
                  "a JSON schema (a dict or a JSON string)")
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
                check(isinstance(schema, dict | bool), "structured_outputs.json", self.json,
                      "a JSON schema (an object)")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, list | tuple) else None
            check(bool(choice) and all(isinstance(c, str) and c for c in choice),
                  "structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, str) and value != ""),
                  f"structured_outputs.{name}", value, "a non-empty string")
        check(self.json_object in (None, True, False), "structured_outputs.json_object",
              self.json_object, "true or absent")
        check(isinstance(self.disable_any_whitespace, bool),
              "structured_outputs.disable_any_whitespace", self.disable_any_whitespace,
              "a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar (a dict schema by its canonical JSON)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return (self.kind, value, self.disable_any_whitespace, self.whitespace_pattern)

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: `Grammars.matcher`)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import gbnf_to_lark

        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON string literals are Lark string literals
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        if self.grammar is not None:
            text = self.grammar
            if "::=" in text:  # GBNF, as llama.cpp and vLLM's EBNF examples write it
                try:
                    text = gbnf_to_lark(text)
                except Exception as exc:  # noqa: BLE001 (GbnfToLarkError, or its parser's)
                    raise ValueError(f"structured_outputs.grammar is not valid GBNF: {exc}"
                                     ) from None
            return LLMatcher.grammar_from_lark(text)
        schema = {"type": "object"} if self.json is None else self.json
        options: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
        if not self.disable_any_whitespace:
            options["whitespace_pattern"] = self.whitespace_pattern or DEFAULT_WHITESPACE
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: {exc}") from None


class Grammars:
    """Compiled constraints for one tokenizer: each distinct constraint is checked and
    compiled once (a matcher in its start state kept as a template, LRU over `capacity`
    constraints) and every request gets a copy of it (`LLMatcher.deep_copy`, microseconds).

    `vocab_size` is the model's (its logits' width, which may exceed the tokenizer's: the
    extra ids are never allowed); `eos_token_ids` end a constrained output (the grammar
    allows them once it is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 capacity: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.capacity = capacity
        self._tokenizer = None  # llguidance's, built on first use (~0.3 s for 49k tokens)
        self._templates: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()  # the server checks requests off the engine thread
        self.compiles = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            if self._hf_tokenizer is None:
                raise ValueError("structured_outputs need the model's tokenizer; this model "
                                 "has none")
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids or None)
        return self._tokenizer

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for `params`; a ValueError naming the field when the schema,
        regex or grammar is not one llguidance can compile."""
        from llguidance import LLMatcher

        key = params.key()
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template.deep_copy()
            grammar = params.llguidance_grammar()
            tokenizer = self.tokenizer
            error = LLMatcher.validate_grammar(grammar, tokenizer)
            if error:
                raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: "
                                 f"{error.strip()}")
            template = LLMatcher(tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: "
                                 f"{template.get_error()}")
            self.compiles += 1
            self._templates[key] = template
            if len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
            return template.deep_copy()


def bitmask_width(vocab_size: int) -> int:
    """int32 words of a next-token bitmask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def token_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """The bitmask row allowing exactly `token_ids`."""
    bits = np.zeros(bitmask_width(vocab_size) * 32, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def fill_bitmasks(matchers: Sequence[tuple[Any, int, Sequence[int]]],
                  bitmask: np.ndarray) -> None:
    """For each (m, i, drafted), fill row i of `bitmask` [R, W] int32 with matcher m's
    next-token mask after the tokens `drafted` (a speculative step's draws at its drafts: the
    matcher reads them, then rolls them back). Rows whose drafts the grammar refuses are left
    as they are (their draws come after a rejected draft: never accepted). One row at a time:
    on a 2-core CPU the device's forward runs meanwhile on the other threads, and
    llguidance's thread pool (`LLExecutor`) would compete with it."""
    from llguidance.numpy import fill_next_token_bitmask

    for matcher, row, drafted in matchers:
        if isinstance(matcher, np.ndarray):  # filled already (`masks_filled`)
            bitmask[row] = matcher
            continue
        if not drafted:
            fill_next_token_bitmask(matcher, bitmask, row)
            continue
        read = matcher.try_consume_tokens(list(drafted))
        if read == len(drafted):
            fill_next_token_bitmask(matcher, bitmask, row)
        matcher.rollback(read)


def masks_filled(seqs: list, vocab_size: int) -> list:
    """`seqs` (a step's SeqInputs) with each constrained sampling row's matcher replaced by
    its mask, filled now: what can be sent to other processes (a matcher cannot be pickled),
    which then pack the same masks (`fill_bitmasks` copies a filled one). Seqs without a
    constrained row are passed as they are (a draft model's drafts are written into those)."""
    out = []
    for seq in seqs:
        if not any(r.matcher is not None for r in seq.sampling):
            out.append(seq)
            continue
        rows = []
        for r in seq.sampling:
            if r.matcher is not None and not isinstance(r.matcher, np.ndarray):
                mask = np.full((1, bitmask_width(vocab_size)), -1, np.int32)
                fill_bitmasks([(r.matcher, 0, r.drafted)], mask)
                r = dataclasses.replace(r, matcher=mask[0], drafted=())
            rows.append(r)
        out.append(dataclasses.replace(seq, sampling=rows))
    return out


def bad_words_token_ids(tokenizer: Any, bad_words: Sequence[str]) -> list[tuple[int, ...]]:
    """vLLM's reading of `bad_words`: each word's token ids as written and with a leading
    space (the latter only where it tokenizes to as many tokens, its first one different)."""
    if tokenizer is None:
        raise ValueError("bad_words need the model's tokenizer; this model has none")
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def bad_word_bans(bad_words: Sequence[tuple[int, ...]], output: Sequence[int]) -> set[int]:
    """The tokens a draw after `output` must not be: a bad word's last token wherever the
    output ends with the rest of it (a one-token word: always)."""
    banned = set()
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or tuple(output[len(output) - len(prefix):]) == prefix:
            banned.add(word[-1])
    return banned
