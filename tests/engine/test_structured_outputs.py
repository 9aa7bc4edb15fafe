"""Structured outputs, logit bias, allowed token ids and bad words.

Oracles: `jsonschema` (every constrained JSON output validates), Python's `re.fullmatch` for
regexes and choices, a float64 NumPy application of the same bitmask / bias to the same
logits, the run of the same requests without the constrained ones, and hand-worked cases
(a one-token mask always draws its token; a bad word's last token never follows its
prefix)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from conftest import build_hf_model, byte_level_bpe_tokenizer

from jaxpage import LLM, SamplingParams, StructuredOutputsParams
from jaxpage.sampling import SamplingMetadata, apply_bitmask, sample
from jaxpage.sampling_params import SamplingRow
from jaxpage.structured import bad_word_bans, token_bitmask

SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
             "properties": {"name": {"type": "string", "maxLength": 8},
                            "age": {"type": "integer", "minimum": 0, "maximum": 150},
                            "nick": {"type": "string", "maxLength": 4}}},
    "arrays_enums": {"type": "object", "additionalProperties": False,
                     "required": ["tags", "score"],
                     "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                             "items": {"enum": ["a", "b", "c"]}},
                                    "score": {"type": "number", "minimum": 0, "maximum": 1}}},
    "nested_ref_anyof": {
        "$defs": {"pt": {"type": "object", "additionalProperties": False,
                         "required": ["x", "y"],
                         "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                        "y": {"type": "integer", "minimum": -5, "maximum": 5}}}},
        "type": "object", "additionalProperties": False, "required": ["a", "kind"],
        "properties": {"a": {"$ref": "#/$defs/pt"},
                       "b": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "null"}]},
                       "kind": {"enum": ["line", "point"]}}},
    "array_of_bools": {"type": "array", "items": {"type": "boolean"}, "minItems": 2,
                       "maxItems": 4},
}
REGEXES = [r"[a-c]{2,5}-\d{1,3}", r"(yes|no)\.", r"\d{3}-\d{4}"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with a 400-token byte-level BPE (random weights: what the
    constraint allows is all that makes its outputs valid)."""
    path = tmp_path_factory.mktemp("structured_llama")
    build_hf_model("llama", vocab_size=400).save_pretrained(path)
    byte_level_bpe_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=512, num_blocks=256, max_num_seqs=32)


def json_params(schema, temperature=0.0, n=1, seed=None):
    # a random model fills whatever whitespace JSON allows; without it outputs end
    return SamplingParams(max_tokens=160, temperature=temperature, n=n, seed=seed,
                          structured_outputs=StructuredOutputsParams(
                              json=schema, disable_any_whitespace=True))


def check_json(completion, schema):
    assert completion.finish_reason == "stop", completion
    jsonschema.validate(json.loads(completion.text), schema)


def test_outputs_validate_in_a_batch_mixing_constrained_and_free_rows(llm):
    """Every schema greedy and sampled with n=3, every regex, a choice and free rows in one
    batch: every constrained output validates, and the free rows' tokens are those of a run
    without the constrained requests."""
    free = [SamplingParams(max_tokens=24, temperature=0.0),
            SamplingParams(max_tokens=24, temperature=0.9, seed=5)]
    constrained, checks = [], []
    for schema in SCHEMAS.values():
        for p in (json_params(schema), json_params(schema, 1.0, n=3, seed=7)):
            constrained.append(p)
            checks.append(("json", schema))
    for regex in REGEXES:
        constrained.append(SamplingParams(max_tokens=16, temperature=0.8, seed=1, n=2,
                                          structured_outputs=StructuredOutputsParams(
                                              regex=regex)))
        checks.append(("regex", regex))
    choices = ["red", "green", "dark blue"]
    constrained.append(SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=2,
                                      structured_outputs=StructuredOutputsParams(
                                          choice=choices)))
    checks.append(("choice", choices))
    prompts = ["the quick brown", "café au lait", "12345 and"] * 10
    params = free + constrained
    outs = llm.generate(prompts[: len(params)], params, use_tqdm=False)
    for out, (kind, spec) in zip(outs[len(free):], checks, strict=True):
        for c in out.outputs:
            if kind == "json":
                check_json(c, spec)
            elif kind == "regex":
                assert c.finish_reason == "stop" and re.fullmatch(spec, c.text), c
            else:
                assert c.finish_reason == "stop" and c.text in spec, c
    alone = llm.generate(prompts[: len(free)], free, use_tqdm=False)
    for mixed, solo in zip(outs[: len(free)], alone, strict=True):
        assert mixed.outputs[0].token_ids == solo.outputs[0].token_ids
    # the n=3 samples are drawn apart (each has its own matcher)
    sampled = [c.text for c in outs[len(free) + 1].outputs]
    assert len(set(sampled)) > 1, sampled


def test_constraints_survive_preemption(model_dir):
    """A pool too small for the batch preempts and recomputes: each constrained request's
    matcher keeps its state, and the outputs equal a run with room to spare."""
    schema = SCHEMAS["nested_ref_anyof"]
    params = [json_params(schema, 1.0, seed=s) for s in range(6)]
    prompts = ["the quick brown fox jumps over the lazy dog " * 3] * 6
    roomy = LLM(model_dir, max_model_len=512, num_blocks=256, block_size=8)
    tight = LLM(model_dir, max_model_len=512, num_blocks=40, block_size=8)
    want = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    for a, b in zip(want, got, strict=True):
        check_json(b.outputs[0], schema)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("structured, message", [
    (dict(regex="[a-"), "regex"),
    (dict(json={"type": "foo"}), "json"),
    (dict(json="{not json"), "json"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(regex="a", choice=["b"]), "exactly one"),
])
def test_a_bad_constraint_is_refused_at_the_door(llm, structured, message):
    """A ValueError naming the field, raised by SamplingParams or add_request; a request
    already running finishes with the tokens it gets alone."""
    engine = llm.engine
    p = SamplingParams(max_tokens=12, temperature=0.0)
    want = llm.generate(["the quick brown"], p, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", "the quick brown", p)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "café", SamplingParams(
            structured_outputs=StructuredOutputsParams(**structured)))
    tokens = {}  # the step outputs are deltas
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert list(tokens) == ["good"] and tokens["good"] == want[1:]


def test_grammar_in_lark_and_gbnf(llm):
    """The same language as a Lark and a GBNF grammar: outputs in it."""
    lark = 'start: item ("," item)*\nitem: "x" | "yy" | NUMBER\nNUMBER: /[0-9]{1,2}/'
    gbnf = 'root ::= item ("," item)*\nitem ::= "x" | "yy" | [0-9] [0-9]?'
    for grammar in (lark, gbnf):
        outs = llm.generate(["hello"], SamplingParams(
            max_tokens=12, temperature=1.0, seed=3, n=4,
            structured_outputs=StructuredOutputsParams(grammar=grammar)), use_tqdm=False)
        for c in outs[0].outputs:
            # a grammar with no end: it stops by length, every prefix in the language
            assert re.fullmatch(r"(x|yy|\d{1,2})(,(x|yy|\d{1,2}))*,?", c.text), c.text


def test_json_whitespace_is_bounded_by_default(llm):
    """With JSON's whitespace allowed (the default) outputs end and validate, no whitespace
    run over 32 characters; a model pushed to whitespace (+100 on the space token) fills each
    place that may hold some up to exactly 32; json_object parses as an object; a
    whitespace_pattern of one optional space holds no other."""
    runs = []
    for schema in (SCHEMAS["flat"], SCHEMAS["array_of_bools"]):
        outs = llm.generate(["hello", "café"], SamplingParams(
            max_tokens=400, temperature=1.0, seed=0, n=2,
            structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
        for out in outs:
            for c in out.outputs:
                check_json(c, schema)
                runs += [len(m) for m in re.findall(r"[ \t\r\n]+", c.text)]
    assert max(runs) <= 32, runs
    space = llm.engine.tokenizer.convert_tokens_to_ids("Ġ")  # " " in the byte-level BPE
    one = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 1}
    out = llm.generate(["hello"], SamplingParams(
        max_tokens=400, temperature=0.0, logit_bias={space: 100.0},
        structured_outputs=StructuredOutputsParams(json=one)), use_tqdm=False)[0].outputs[0]
    check_json(out, one)
    assert {len(m) for m in re.findall(r"\s+", out.text)} == {32}, out.text
    outs = llm.generate(["hello"], SamplingParams(
        max_tokens=200, temperature=1.0, seed=1, n=3, structured_outputs=StructuredOutputsParams(
            json_object=True, whitespace_pattern=r"[ ]?")), use_tqdm=False)
    for c in outs[0].outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        assert not re.search(r"[\t\r\n]", c.text), c.text  # JSON strings hold none raw


def test_sentencepiece_style_tokenizer(tmp_path):
    """A Llama-style tokenizer (metaspace, byte fallback) bridged to llguidance: regex
    outputs match, including bytes drawn as <0xNN> tokens."""
    from conftest import CORPUS, SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=[*SPECIAL_TOKENS, "<unk>", *byte_tokens])
    tok.train_from_iterator(CORPUS, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", unk_token="<unk>")
    build_hf_model("llama", vocab_size=len(hf_tok)).save_pretrained(tmp_path)
    hf_tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=256, num_blocks=64)
    regex = r"(café|naïve|日本) [0-9]{2}\."
    outs = llm.generate(["The quick"], SamplingParams(
        max_tokens=24, temperature=1.0, seed=0, n=6,
        structured_outputs=StructuredOutputsParams(regex=regex)), use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c


# ---------------------------------------------------------------- the sampler's masks


def rows_md(params, vocab_size, matchers=None, seeds=None):
    rows = [SamplingRow(p, seed=s, step=0, matcher=None)
            for p, s in zip(params, seeds or range(len(params)), strict=True)]
    return SamplingMetadata.pack(rows, len(rows), ban_buckets=[8, 64, 512],
                                 history_buckets=[128], vocab_size=vocab_size)


@pytest.mark.parametrize("vocab_size", [97, 400, 1000])
def test_bitmask_matches_numpy(vocab_size):
    """apply_bitmask leaves exactly the tokens whose bit is set (NumPy unpacking of the same
    words), greedy draws the best allowed token and every log-probability is float64
    NumPy's log-softmax of the masked logits."""
    rng = np.random.default_rng(vocab_size)
    logits = rng.standard_normal((6, vocab_size)).astype(np.float32) * 3
    allowed = rng.random((6, vocab_size)) < [[0.5], [0.1], [0.01], [1.0], [0.3], [0.0]]
    allowed[5, rng.integers(vocab_size)] = True  # one token only
    allowed[2, 0] = True
    mask = np.stack([token_bitmask(np.flatnonzero(a), vocab_size) for a in allowed])
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    np.testing.assert_array_equal(bits.astype(bool), allowed)
    masked = np.asarray(jax.jit(apply_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(np.isfinite(masked), allowed)
    np.testing.assert_array_equal(masked[allowed], logits[allowed])
    md = rows_md([SamplingParams(temperature=0.0, logprobs=5)] * 6, vocab_size)
    md = SamplingMetadata(**{**vars(md), "grammar_bitmask": jnp.asarray(mask)})
    out = jax.jit(sample)(jnp.asarray(logits), md)
    ref = np.where(allowed, logits.astype(np.float64), -np.inf)
    np.testing.assert_array_equal(np.asarray(out["tokens"]), ref.argmax(-1))
    log_softmax = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1,
                                                                            keepdims=True)) \
        - ref.max(-1, keepdims=True)
    chosen = np.take_along_axis(log_softmax, ref.argmax(-1)[:, None], -1)[:, 0]
    np.testing.assert_allclose(np.asarray(out["logprob"]), chosen, atol=1e-5)
    assert np.asarray(out["logprob"])[5] == 0.0  # the one allowed token is certain


def test_a_one_token_mask_always_draws_it():
    """Sampling with filters and high temperature, 512 rows, each allowing one token: each
    draws it."""
    vocab_size, rows = 300, 512
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((rows, vocab_size)).astype(np.float32) * 5
    only = rng.integers(vocab_size, size=rows)
    mask = np.stack([token_bitmask([t], vocab_size) for t in only])
    md = rows_md([SamplingParams(temperature=2.0, top_p=0.9, top_k=50)] * rows, vocab_size)
    md = SamplingMetadata(**{**vars(md), "grammar_bitmask": jnp.asarray(mask)})
    out = jax.jit(sample)(jnp.asarray(logits), md)
    np.testing.assert_array_equal(np.asarray(out["tokens"]), only)


def test_logit_bias_and_allowed_ids_against_numpy():
    """Greedy draws are NumPy's argmax of the biased logits restricted to the allowed ids;
    the log-probabilities reported stay the model's (no bias, no restriction)."""
    vocab_size = 200
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, vocab_size)).astype(np.float32)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 5.0, 9: -100.0}),
              SamplingParams(temperature=0.0, allowed_token_ids=[3, 11, 150]),
              SamplingParams(temperature=0.0, allowed_token_ids=[3, 11], logit_bias={3: -3.0}),
              SamplingParams(temperature=0.0)]
    md = rows_md(params, vocab_size)
    out = jax.jit(sample)(jnp.asarray(logits), md)
    ref = logits.astype(np.float64).copy()
    ref[0, 7] += 5.0
    ref[0, 9] -= 100.0
    ref[1, np.setdiff1d(np.arange(vocab_size), [3, 11, 150])] = -np.inf
    ref[2, np.setdiff1d(np.arange(vocab_size), [3, 11])] = -np.inf
    ref[2, 3] -= 3.0
    tokens = ref.argmax(-1)
    np.testing.assert_array_equal(np.asarray(out["tokens"]), tokens)
    raw = logits.astype(np.float64)
    raw_logprobs = raw - np.log(np.exp(raw).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out["logprob"]),
                               raw_logprobs[np.arange(4), tokens], atol=1e-5)


# ---------------------------------------------------------------- the engine's token controls


def test_logit_bias_and_allowed_token_ids_in_the_engine(llm):
    """+100 on a token makes a greedy request emit it every time; allowed_token_ids keeps
    every sampled token in the set; a token id past the vocabulary is refused."""
    out = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0,
                                                 logit_bias={123: 100.0}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [123] * 8
    allowed = [40, 41, 42, 300]
    out = llm.generate(["hello"], SamplingParams(max_tokens=16, temperature=1.5, seed=0, n=3,
                                                 allowed_token_ids=allowed), use_tqdm=False)
    drawn = {t for c in out[0].outputs for t in c.token_ids}
    assert drawn <= set(allowed) and len(drawn) > 1
    for field, value in (("logit_bias", {400: 1.0}), ("allowed_token_ids", [1, 400])):
        with pytest.raises(ValueError, match=field):
            llm.generate(["hello"], SamplingParams(**{field: value}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logit_bias\[5\]"):
        SamplingParams(logit_bias={5: 101.0})


def test_bad_words_ban_the_last_token_after_the_prefix(llm):
    """Hand-worked: take two tokens of a greedy output that tokenize back to themselves as
    a word; banned as a bad word, the output is the same up to the first, then differs
    there and never holds the pair."""
    tok = llm.engine.tokenizer
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt in ("the quick brown", "12345 and", "café au lait", "hello"):
        base = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
        pairs = [i for i in range(1, len(base) - 1)
                 if tok.encode(tok.decode(base[i:i + 2]).lstrip(), add_special_tokens=False)
                 == base[i:i + 2] and base[i] != base[i + 1]]
        if pairs:
            break
    i = pairs[0]
    word = tok.decode(base[i:i + 2])
    got = llm.generate([prompt], SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, bad_words=[word]),
        use_tqdm=False)[0].outputs[0].token_ids
    assert got[: i + 1] == base[: i + 1] and got[i + 1] != base[i + 1]
    pairs = set(zip(got, got[1:], strict=False))
    assert tuple(base[i:i + 2]) not in pairs


def test_bad_word_bans_hand_worked():
    words = [(5,), (1, 2), (1, 2, 3)]
    assert bad_word_bans(words, []) == {5}
    assert bad_word_bans(words, [9, 1]) == {5, 2}
    assert bad_word_bans(words, [1, 2]) == {5, 3}
    assert bad_word_bans(words, [2]) == {5}


@pytest.mark.slow
def test_default_model_json_schemas():
    """SmolLM2-135M-Instruct (its GGUF tokenizer bridged to llguidance) under each schema,
    whitespace allowed (the default), greedy and sampled, and each regex sampled with n=2:
    every output validates."""
    llm = LLM(dtype="bfloat16", max_model_len=1024)
    for schema in SCHEMAS.values():
        outs = llm.chat([[{"role": "user", "content": "Reply in JSON."}]] * 2, [
            SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=
                           StructuredOutputsParams(json=schema)),
            SamplingParams(max_tokens=200, temperature=0.8, seed=0, n=2, structured_outputs=
                           StructuredOutputsParams(json=schema))], use_tqdm=False)
        for out in outs:
            for c in out.outputs:
                check_json(c, schema)
    for regex in REGEXES:
        outs = llm.chat([[{"role": "user", "content": "Answer in the format asked."}]], [
            SamplingParams(max_tokens=24, temperature=0.8, seed=1, n=2, structured_outputs=
                           StructuredOutputsParams(regex=regex))], use_tqdm=False)
        for c in outs[0].outputs:
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c


def test_speculative_drafts_under_a_constraint(model_dir):
    """n-gram drafts for constrained requests: trimmed to what the grammar allows, each draft
    position drawn under the mask after the drafts before it (the matcher reads them, then
    rolls back). Drafts are accepted, and every request's tokens are those of a run without
    speculation (greedy and seeded sampling), each output valid."""
    schema = {"type": "array", "minItems": 6, "maxItems": 10,
              "items": {"enum": ["ab", "cd", "ab,cd"]}}
    regex = r"(xy|zw){6,20}!"
    params = [json_params(schema), json_params(schema, 1.0, seed=4),
              SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=
                             StructuredOutputsParams(regex=regex)),
              SamplingParams(max_tokens=24, temperature=0.0)]
    prompts = ["the quick brown", "café au lait", "12345 and", "the quick brown fox"]
    kwargs = dict(max_model_len=512, num_blocks=256, max_num_seqs=8)
    plain = LLM(model_dir, **kwargs).generate(prompts, params, use_tqdm=False)
    spec = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_min": 2}, **kwargs)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert spec.stats()["spec_decode"]["num_accepted_tokens"] > 0
    for want, out in zip(plain, got, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    for out in got[:2]:
        check_json(out.outputs[0], schema)
    assert re.fullmatch(regex, got[2].outputs[0].text)


def test_masks_filled_ahead_give_the_same_tokens(model_dir):
    """What several processes run (`jaxpage.distributed`: a matcher cannot be sent, so the
    leader fills each constrained row's mask before it broadcasts the step): the runner
    given filled masks (`structured.masks_filled`) draws the tokens it draws from the
    matchers, n-gram drafts included."""
    from jaxpage.structured import masks_filled

    schema = SCHEMAS["nested_ref_anyof"]
    params = [json_params(schema), json_params(schema, 1.0, n=2, seed=3),
              SamplingParams(max_tokens=16, temperature=0.0)]
    prompts = ["the quick brown", "café au lait", "12345 and"]
    kwargs = dict(max_model_len=512, num_blocks=256, max_num_seqs=8,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 2})
    want = LLM(model_dir, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(model_dir, **kwargs)
    runner = llm.engine.runner
    execute, filled = runner.execute, []

    def execute_filled(seqs):
        ahead = masks_filled(seqs, 400)
        filled.extend(r.matcher for s in ahead for r in s.sampling
                      if isinstance(r.matcher, np.ndarray))
        return execute(ahead)

    runner.execute = execute_filled
    got = llm.generate(prompts, params, use_tqdm=False)
    assert filled
    for a, b in zip(want, got, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
