"""The runner interface (jaxpage.engine.runner_api): JAX-free, implemented by ModelRunner; the
device work the engine queues makes exactly the runner call it names; the step timer's
phases cover the engine's steps."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time

import pytest

from jaxpage.engine.runner_api import (
    ENGINE_PHASES,
    RUNNER_PHASES,
    CopyBlocks,
    FillBlocks,
    Runner,
    StepTimer,
    SwapIn,
    SwapOut,
)


def test_runner_api_imports_no_jax():
    code = ("import sys, jaxpage.engine.runner_api\n"
            "assert not {'jax', 'jaxlib', 'pallas_kernels'} & set(sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


class Recorder:
    """Records the runner calls made on it, with their positional arguments."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


@pytest.mark.parametrize("item, call", [
    (SwapOut([(3, 0)]), ("swap_out", ([(3, 0)],))),
    (SwapIn([(0, 5)]), ("swap_in", ([(0, 5)],))),
    (CopyBlocks([(1, 2)]), ("copy_blocks", ([(1, 2)],))),
    (CopyBlocks([(1, 2)], True), ("copy_blocks", ([(1, 2)], True))),
    (FillBlocks([4], 0.5), ("fill_blocks", ([4], 0.5))),
    (FillBlocks([4], 0.5, True), ("fill_blocks", ([4], 0.5, True))),
])
def test_device_work_makes_its_call(item, call):
    """Each item makes one call, its arguments positional (as MultiHostRunner forwards them
    and as a one-argument stand-in for copy_blocks takes them); it cannot be changed once
    queued, and says what it touches."""
    runner = Recorder()
    item.run(runner)
    assert runner.calls == [(*call, {})]
    assert item.kind == call[0] and item.blocks == call[1][0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(item, dataclasses.fields(item)[0].name, [])


def test_step_timer_adds_each_phase_since_the_last_mark():
    timer = StepTimer(RUNNER_PHASES)
    start = timer.start()
    time.sleep(0.01)
    timer.mark("prepare")
    timer.mark("dispatch")
    assert timer.seconds["prepare"] >= 0.009 and timer.seconds["wait"] == 0
    assert math.isclose(sum(timer.seconds.values()), timer._last - start)
    timer.reset()
    assert timer.seconds == dict.fromkeys(RUNNER_PHASES, 0.0)


def test_model_runner_is_a_runner_and_its_phases_cover_the_steps(hf_model_dir):
    from jaxpage import LLM, SamplingParams

    path, _ = hf_model_dir("llama")
    llm = LLM(path, num_blocks=32, max_num_seqs=4, block_size=4)
    engine = llm.engine
    assert isinstance(engine.runner, Runner)
    assert engine.warmup()[0] > 0
    assert sum(engine.runner.timer.seconds.values()) == 0  # warm-up's steps are not steps
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, temperature=0.0,
                                                            ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    stats = llm.stats()
    phases = stats["step_phases"]
    assert list(phases) == ["schedule", *RUNNER_PHASES, "device_other", "update", "outputs"]
    assert min(phases.values()) >= 0 and phases["readback"] > 0 and phases["dispatch"] > 0
    assert sum(phases.values()) <= stats["step_seconds"]
    assert set(engine.timer.seconds) == set(ENGINE_PHASES)
