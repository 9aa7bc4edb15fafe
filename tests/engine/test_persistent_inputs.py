"""The scheduler keeps a plain decode's records from step to step (`Request.decode_records`):
its ScheduledChunk and SeqInput are updated in place, not made anew. What the runner is given
must not show it: at every step each sequence's input equals one built by hand from the
request and allocator as they stand then (its block table, position, last token and sampling
row: the request's params and seed, the step its output index), and the greedy request's
tokens are HF transformers'. Requests with min_tokens (their first rows carry the EOS ban),
forks (n = 2) and preemptions by recompute (a pool too small for all of them) pass through
the same steps."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from jaxpage import LLM, SamplingParams
from jaxpage.engine.batch import SeqInput
from jaxpage.sampling_params import SamplingRow


@pytest.fixture(scope="module")
def tiny(hf_model_dir):
    return hf_model_dir("llama")


def expected_input(engine, request, seq: SeqInput) -> SeqInput:
    """A plain decode's input as the request and allocator stand: built here, field by field."""
    start = request.num_computed_tokens
    return SeqInput(engine.allocator.block_table(request.seq_id), start,
                    [request.token_ids[start]],
                    [SamplingRow(request.params, request.seed, request.num_output_tokens)],
                    None, seq.may_run_ahead, seq.ends)


def test_decode_inputs_are_kept_and_each_step_sees_its_own(tiny):
    llm = LLM(tiny[0], block_size=4, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    engine = llm.engine
    runner = engine.runner
    seen: list[list[SeqInput]] = []  # per step, the runner's inputs
    execute = runner.execute

    def spy(seqs):
        seen.append(list(seqs))
        by_input = {id(r.decode_records[1]): r for r in engine.scheduler.running
                    if r.decode_records is not None}
        for s in seqs:  # a plain decode's input: the one kept for its request, as built here
            request = by_input.get(id(s))
            if request is not None and len(s.token_ids) == 1:
                assert s == expected_input(engine, request, s)
        return execute(seqs)

    runner.execute = spy
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=0, min_tokens=6),
              SamplingParams(max_tokens=16, n=2, temperature=1.0, seed=5, ignore_eos=True)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", list(range(3 + i, 14 + i)), p)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    runner.execute = execute

    assert engine.stats()["num_preemptions"] > 0
    # the same input objects served many steps, each checked above as it stood
    ids = [id(s) for step in seen for s in step]
    assert len(ids) - len(set(ids)) > 20
    # a min_tokens row banned EOS while it was short of them: never a kept plain row then
    banned = [s for step in seen for s in step if s.sampling and s.sampling[0].banned_token_ids]
    assert banned and all(s.sampling[0].params.min_tokens == 6 for s in banned)
    # and the greedy request's tokens, beside the preemptions, are HF's
    assert outputs["r0"] == hf_greedy(tiny[1], list(range(3, 14)), 20)
