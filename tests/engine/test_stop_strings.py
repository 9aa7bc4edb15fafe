"""Stop strings through incremental detokenization, with a real (tiny) HF tokenizer."""

from __future__ import annotations

import pytest

from jaxpage import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(97)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2")
    path, _ = hf_model_dir("llama")
    return LLM(path, tokenizer=tokenizer, block_size=4, num_blocks=64,
               max_num_batched_tokens=64, max_num_seqs=4)


PROMPT = "w10 w11 w12 w13 w14 w15"


def greedy(llm, **kwargs):
    return llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                 **kwargs), use_tqdm=False)[0].outputs[0]


def test_text_is_the_decoded_continuation(llm):
    out = greedy(llm)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    whole = llm.tokenizer.decode(prompt_ids + out.token_ids, skip_special_tokens=True)
    prompt_text = llm.tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert out.text == whole[len(prompt_text):]


def test_stop_string_ends_generation_and_is_not_in_the_text(llm):
    full = greedy(llm)
    stop = full.text.split()[3]  # the 4th generated word
    out = greedy(llm, stop=[stop, "never-appears"])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[:4]


def test_streamed_deltas_add_up_and_never_show_a_stop_string_prefix(llm):
    full = greedy(llm)
    stop = full.text.split()[5]
    engine = llm.engine
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=10, temperature=0,
                                                   ignore_eos=True, stop=[stop]))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
    text = "".join(deltas)
    assert text == full.text[: full.text.index(stop)]
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_min_tokens_defers_stop_strings(llm):
    full = greedy(llm)
    stop = full.text.split()[1]  # would stop after 2 tokens
    out = greedy(llm, stop=[stop], min_tokens=5)
    assert len(out.token_ids) >= 5
