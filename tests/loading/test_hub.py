"""Models named by Hugging Face Hub id, loaded from a Hub cache written on disk in the Hub's
layout (`models--org--name/refs/<branch>`, `snapshots/<commit>/`) with HF_HUB_OFFLINE=1: the
tokens of the directory itself, the snapshot `revision` names, clear errors."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import hf_greedy

from jaxpage import LLM, SamplingParams

COMMITS = {"main": "a" * 40, "v2": "b" * 40}
PROMPT = [5, 17, 33, 8, 41]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture()
def hub(tmp_path, monkeypatch, hf_model_dir):
    """A Hub cache holding org/tiny: branch main at seed 0's tiny llama, v2 at seed 1's;
    org/broken: a snapshot without weights. Offline. Returns {branch: HF model}."""
    cache = tmp_path / "hub"
    models = {}
    for (branch, commit), seed in zip(COMMITS.items(), (0, 1), strict=True):
        path, models[branch] = hf_model_dir("llama", seed)
        repo = cache / "models--org--tiny"
        shutil.copytree(path, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    broken = cache / "models--org--broken"
    (broken / "snapshots" / ("c" * 40)).mkdir(parents=True)
    shutil.copy(os.path.join(hf_model_dir("llama")[0], "config.json"),
                broken / "snapshots" / ("c" * 40) / "config.json")
    (broken / "refs").mkdir()
    (broken / "refs" / "main").write_text("c" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return models


def greedy(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_a_hub_id_loads_its_cached_snapshot_offline(hub):
    """"org/tiny" is its main branch's snapshot; revision="v2" (a branch) and v2's commit
    pick the other one: each the tokens HF's model of that snapshot gives."""
    main = hf_greedy(hub["main"], PROMPT, 6)
    other = hf_greedy(hub["v2"], PROMPT, 6)
    assert main != other  # the two snapshots are told apart
    assert greedy(LLM("org/tiny", num_blocks=16)) == main
    assert greedy(LLM("org/tiny", revision="v2", num_blocks=16)) == other
    assert greedy(LLM("org/tiny", revision=COMMITS["v2"], num_blocks=16)) == other


def test_a_local_path_wins_over_a_hub_id(hub, tmp_path, monkeypatch, hf_model_dir):
    """A directory spelled "org/tiny" under the working directory is loaded, not the Hub's
    snapshot of that id."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_model_dir("llama", 1)[0], tmp_path / "org" / "tiny")
    assert greedy(LLM("org/tiny", num_blocks=16)) == hf_greedy(hub["v2"], PROMPT, 6)


def test_missing_models_and_files_fail_clearly(hub):
    """An id not in the cache (offline), an unknown revision, a snapshot without weights:
    each an error naming the id (and the cache), nothing loaded."""
    cache = os.environ["HF_HUB_CACHE"]
    with pytest.raises(FileNotFoundError, match="'org/missing'.*not in the cache and "
                                                "HF_HUB_OFFLINE is set") as info:
        LLM("org/missing", num_blocks=16)
    assert cache in str(info.value)
    with pytest.raises(FileNotFoundError, match="'org/tiny' at revision 'v9'"):
        LLM("org/tiny", revision="v9", num_blocks=16)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        LLM("org/broken", num_blocks=16)
    with pytest.raises(ValueError, match="revision must be None or a non-empty"):
        LLM("org/tiny", revision="", num_blocks=16)
