"""A model that is not jaxpage's own: the Flax NNX example served through `LLM` decodes the
same greedy tokens as an independent dense, cache-free forward over the same weights; the
low-level loop (allocator + pool + own jitted step) matches the engine; and models that break
the protocol are refused at `LLM(...)` with a ValueError naming what is wrong."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpage import LLM, SamplingParams
from jaxpage.model_protocol import validate_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MAX_TOKENS = 8
BLOCK_SIZE = 8


def _import_example(name: str):
    """Import examples/<name>.py (examples/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


nnx_example = _import_example("flax_nnx_decoder")
low_level = _import_example("low_level_loop")


# ------------------------------------------------------------------ the independent oracle

def _rms_norm(x, scale, eps):
    return scale * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, positions, theta):
    """x: [L, heads, D] rotated by half-split rotary embedding at positions [L]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)  # [D/2]
    angles = positions[:, None] * inv_freq[None, :]  # [L, D/2]
    angles = np.concatenate([angles, angles], axis=-1)[:, None, :]  # [L, 1, D]
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def _softmax(x):
    x = np.exp(x - x.max(axis=-1, keepdims=True))
    return x / x.sum(axis=-1, keepdims=True)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def dense_logits(cfg, weights, token_ids) -> np.ndarray:
    """The decoder's math in float64 numpy with dense causal attention over the whole
    sequence and no KV cache: [L] token ids -> [L, vocab] logits. `weights` is a plain dict."""
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), weights)
    length = len(token_ids)
    group = cfg.num_heads // cfg.num_kv_heads
    x = w["embed"]["embedding"][np.asarray(token_ids)]  # [L, H]
    positions = np.arange(length, dtype=np.float64)
    causal = np.tril(np.ones((length, length), bool))  # [Lq, Lk]
    for i in range(cfg.num_layers):
        layer = w["layers"][i]
        attn = layer["attn"]
        h = _rms_norm(x, layer["attn_norm"]["scale"], cfg.rms_norm_eps)
        q = (h @ attn["q_proj"]["kernel"]).reshape(length, cfg.num_heads, cfg.head_dim)
        k = (h @ attn["k_proj"]["kernel"]).reshape(length, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ attn["v_proj"]["kernel"]).reshape(length, cfg.num_kv_heads, cfg.head_dim)
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [L, Hq, D]
        scores = np.einsum("qhd,khd->hqk", q, k) * cfg.head_dim**-0.5  # [Hq, Lq, Lk]
        probs = _softmax(np.where(causal, scores, -np.inf))
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(length, -1)  # [L, Hq * D]
        x = x + out @ attn["o_proj"]["kernel"]
        h = _rms_norm(x, layer["mlp_norm"]["scale"], cfg.rms_norm_eps)
        mlp = layer["mlp"]
        x = x + (_silu(h @ mlp["gate"]["kernel"]) * (h @ mlp["up"]["kernel"])) @ (
            mlp["down"]["kernel"])
    x = _rms_norm(x, w["final_norm"]["scale"], cfg.rms_norm_eps)
    return x @ w["lm_head"]["kernel"]


def dense_greedy(cfg, weights, prompt, max_tokens) -> list[int]:
    """Greedy decoding by full recompute of the whole sequence every step."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(np.argmax(dense_logits(cfg, weights, tokens)[-1])))
    return tokens[len(prompt):]


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def nnx_model():
    return nnx_example.build(nnx_example.DecoderConfig(), seed=0)


@pytest.fixture(scope="module")
def prompts():
    """Two waves of mixed-length prompts; the second shares a 20-token prefix (two full blocks
    of 8) with the first, and repeats one first-wave prompt exactly."""
    rng = np.random.default_rng(0)
    vocab = nnx_example.DecoderConfig().vocab_size

    def draw(n):
        return rng.integers(0, vocab, size=n).tolist()

    prefix = draw(20)
    first = [draw(1), prefix + draw(5), draw(9), draw(33)]
    second = [prefix + draw(2), prefix + draw(17), draw(4), first[3]]
    return first, second


@pytest.fixture(scope="module")
def dense_expected(nnx_model, prompts):
    model, params = nnx_model
    weights = nnx.to_pure_dict(params)
    return [[dense_greedy(model.config, weights, p, MAX_TOKENS) for p in wave] for wave in prompts]


@pytest.fixture(scope="module")
def served(nnx_model, prompts):
    """(token ids per wave, stats) from serving the NNX model through LLM, prefix caching on."""
    model, params = nnx_model
    llm = LLM(model=model, params=params, block_size=BLOCK_SIZE, num_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=64, enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    waves = []
    for wave in prompts:
        outs = llm.generate(wave, greedy, use_tqdm=False)
        waves.append([out.outputs[0].token_ids for out in outs])
    llm.engine.allocator.check_invariants()
    return waves, llm.stats()


# ------------------------------------------------------------------ (1) engine vs dense oracle

def test_nnx_model_served_matches_dense_recompute(served, dense_expected, prompts):
    waves, stats = served
    for w, (got_wave, exp_wave) in enumerate(zip(waves, dense_expected, strict=True)):
        for i, (got, exp) in enumerate(zip(got_wave, exp_wave, strict=True)):
            assert got == exp, f"wave {w} prompt {i} (len {len(prompts[w][i])})"
    assert stats["prefix_cache_hits"] > 0, "the shared prefix should hit the prefix cache"
    assert stats["kv_blocks_used"] == 0, "blocks leaked after all requests finished"


def test_nnx_outputs_are_not_degenerate(dense_expected):
    # a check on the check: random weights that emit one token forever would prove little
    tokens = {t for wave in dense_expected for out in wave for t in out}
    assert len(tokens) > 10


# ------------------------------------------------------------------ (2) low-level loop

def test_low_level_loop_matches_engine(nnx_model, prompts, served, dense_expected):
    model, params = nnx_model
    all_prompts = prompts[0] + prompts[1]
    stats: dict = {}
    got = low_level.greedy_generate(model, params, all_prompts, MAX_TOKENS,
                                    block_size=BLOCK_SIZE, stats=stats)
    assert got == served[0][0] + served[0][1]
    assert got == dense_expected[0] + dense_expected[1]
    assert stats["prefix_cache_hits"] > 0


def test_low_level_loop_runs_the_llama_model(capsys):
    # the loop is model-agnostic: the example's own main() drives jaxpage's LlamaModel
    low_level.main()
    assert "prefix-cache hits: 16 of 50" in capsys.readouterr().out


def test_reference_llama_model_meets_the_protocol():
    validate_model(*low_level.random_llama())


# ------------------------------------------------------------------ (3) protocol violations

@dataclasses.dataclass(frozen=True)
class AllRowsModel(nnx_example.NNXModel):
    """Ignores metadata.logits_indices: returns logits for every token, [T, V]."""

    def forward(self, params, token_ids, positions, kv_pool, metadata):
        metadata = dataclasses.replace(metadata, logits_indices=None)
        return super().forward(params, token_ids, positions, kv_pool, metadata)


@dataclasses.dataclass(frozen=True)
class DropsLayerModel(nnx_example.NNXModel):
    """Returns a KV pool one layer short."""

    def forward(self, params, token_ids, positions, kv_pool, metadata):
        logits, kv_pool = super().forward(params, token_ids, positions, kv_pool, metadata)
        return logits, kv_pool[:-1]


@dataclasses.dataclass(frozen=True)
class NoHeadDimConfig:
    vocab_size: int = 101
    num_layers: int = 2
    num_kv_heads: int = 2
    max_position_embeddings: int = 256


@dataclasses.dataclass(frozen=True)
class LayerTypesConfig(nnx_example.DecoderConfig):
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class NoForward:
    config: nnx_example.DecoderConfig


@dataclasses.dataclass  # eq without frozen: __hash__ is None
class UnhashableModel:
    graphdef: nnx.GraphDef
    config: nnx_example.DecoderConfig

    forward = nnx_example.NNXModel.forward


def _broken(case: str):
    config = nnx_example.DecoderConfig()
    graphdef, state = nnx.split(nnx_example.Decoder(config, rngs=nnx.Rngs(0)))
    if case == "logits shape":
        return AllRowsModel(graphdef, config), state
    if case == "kv heads":
        # the module is built with 4 KV heads, its config claims 2: the pool has 2
        wide = dataclasses.replace(config, num_kv_heads=4)
        graphdef, state = nnx.split(nnx_example.Decoder(wide, rngs=nnx.Rngs(0)))
        return nnx_example.NNXModel(graphdef, config), state
    if case == "missing field":
        return nnx_example.NNXModel(graphdef, NoHeadDimConfig()), state
    if case == "non-positive":
        return nnx_example.NNXModel(graphdef, dataclasses.replace(config, num_layers=0)), state
    if case == "inconsistent heads":
        return nnx_example.NNXModel(graphdef, dataclasses.replace(config, num_heads=3)), state
    if case == "kv pool returned":
        return DropsLayerModel(graphdef, config), state
    if case == "layer types":
        typed = LayerTypesConfig(**dataclasses.asdict(config), sliding_window=8,
                                 layer_types=("full_attention",))
        return nnx_example.NNXModel(graphdef, typed), state
    if case == "sliding without window":
        typed = LayerTypesConfig(**dataclasses.asdict(config),
                                 layer_types=("sliding_attention", "full_attention"))
        return nnx_example.NNXModel(graphdef, typed), state
    if case == "no forward":
        return NoForward(config), state
    if case == "unhashable":
        return UnhashableModel(graphdef, config), state
    if case == "params not arrays":
        return nnx_example.NNXModel(graphdef, config), {"embed": "weights.bin"}
    if case == "rng key in params":  # e.g. the state of an nnx.Dropout's Rngs
        return nnx_example.NNXModel(graphdef, config), {"dropout": jax.random.key(0)}
    raise AssertionError(case)


@pytest.mark.parametrize(("case", "message"), [
    ("logits shape", r"logits of shape \(3, 101\).*\[2, 101\]"),
    ("kv heads", r"num_kv_heads=2"),
    ("missing field", r"missing head_dim"),
    ("non-positive", r"config\.num_layers must be an integer >= 1, got 0"),
    ("inconsistent heads", r"num_heads \(3\) must be a positive multiple of num_kv_heads \(2\)"),
    ("kv pool returned", r"kv_pool"),
    ("layer types", r"layer_types must be None or num_layers=2 of"),
    ("sliding without window", r"layer_types has sliding layers but sliding_window is None"),
    ("no forward", r"no `forward"),
    ("unhashable", r"must be hashable"),
    ("params not arrays", r"params\['embed'\] is a str"),
    ("rng key in params", r"params\['dropout'\] is a PRNG key array"),
])
def test_protocol_violation_is_refused_at_llm(case, message):
    model, params = _broken(case)
    with pytest.raises(ValueError, match=message):
        LLM(model=model, params=params, num_blocks=16)


def test_kv_head_mismatch_names_the_pool_shape():
    model, params = _broken("kv heads")
    with pytest.raises(ValueError) as info:
        LLM(model=model, params=params, num_blocks=16)
    text = str(info.value)
    assert "[2, 3, 16, 12]" in text and "forward failed" in text, text
