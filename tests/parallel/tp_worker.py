"""Tensor-parallel checks that need several devices: run as a subprocess with 8 virtual CPU
devices (`python tp_worker.py CASE ARGS...`); prints one JSON line the tests assert on.

The oracle of every token comparison is the same model on one device (tp 1) in the same
process, serving the same workload.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import build_hf_model  # noqa: E402

from jaxpage import LLM, BeamSearchParams, LoRARequest, SamplingParams  # noqa: E402

# 8 query / 2 KV heads (KV heads replicated at tp 4 and 8); a SmolLM2-shaped 9 / 3 (tp 3)
MODELS = {
    "llama8": dict(name="llama", num_attention_heads=8, num_key_value_heads=2,
                   hidden_size=64, vocab_size=128),
    "smollm9": dict(name="smollm2", vocab_size=96, intermediate_size=72),
    # wide enough that the replicated norms are < 1% of a device's share
    "llama8_wide": dict(name="llama", num_attention_heads=8, num_key_value_heads=2,
                        hidden_size=256, intermediate_size=512, vocab_size=128),
}
# alternating 16-token sliding windows and global layers: both KV groups sharded
MODELS["gemma2"] = dict(name="gemma2")
# mixtures of experts, 8 experts split over the devices (expert parallelism); Qwen3-MoE with
# dense layers between its MoE ones
MODELS["mixtral8"] = dict(name="mixtral", num_attention_heads=8, num_key_value_heads=2)
MODELS["qwen3_moe8"] = dict(name="qwen3_moe_sparse", num_attention_heads=8,
                            num_key_value_heads=2)
PREFIX = list(range(40, 60))  # shared by two prompts: prefix-cache hits


def model_dir(kind: str) -> str:
    spec = dict(MODELS[kind])
    path = tempfile.mkdtemp()
    name = spec.pop("name")
    if name.startswith("gemma"):
        from models.gemma_models import build_gemma

        build_gemma(name, 0, **spec).save_pretrained(path)
    elif name.startswith(("mixtral", "qwen3_moe")):
        from models.moe_models import build_moe_model

        build_moe_model(name, 0, **spec).save_pretrained(path)
    else:
        build_hf_model(name, 0, **spec).save_pretrained(path)
    return path


def workload(llm: LLM) -> dict:
    """Greedy prompts (one chunked), seeded n=2 samples, seeded samples under every penalty,
    on a pool small enough to preempt; then a prompt sharing a cached prefix, then a beam
    search. Returns every token and the stats."""
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=12, temperature=0.8, seed=5, presence_penalty=1.0,
                               frequency_penalty=0.5, repetition_penalty=1.2, ignore_eos=True)
    first = llm.generate(
        [list(range(3, 8)), PREFIX + [70, 71], list(range(3, 60)), list(range(80, 90)),
         list(range(40, 47))],
        [greedy] * 3 + [SamplingParams(n=2, max_tokens=10, temperature=0.9, seed=7,
                                       ignore_eos=True), penalized], use_tqdm=False)
    again = llm.generate([PREFIX + [72]], greedy, use_tqdm=False)
    beams = llm.beam_search([list(range(20, 31))], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                    ignore_eos=True))
    stats = llm.stats()
    return {"tokens": [[c.token_ids for c in o.outputs] for o in first + again + beams],
            "preemptions": stats["num_preemptions"], "hits": stats["prefix_cache_hits"],
            "again_cached": again[0].metrics.num_cached_tokens,
            "run_ahead": stats["lookahead_hits"]}


# a pool small enough that the workload preempts, a token budget that chunks its long prompt
ENGINE_FOR_TOKENS = dict(block_size=4, num_blocks=30, max_num_batched_tokens=32,
                         max_num_seqs=6, debug_nan_pool=True)


def tokens(kind: str, backend: str, sizes: str, preemption: str = "recompute",
           kv_cache_dtype: str = "auto") -> dict:
    path = model_dir(kind)
    engine = dict(ENGINE_FOR_TOKENS, attention_backend=backend,
                  kernel_interpret=backend.startswith("pallas"), kv_cache_dtype=kv_cache_dtype)
    if backend.startswith("pallas"):  # the TPU kernel's tiles: 8 tokens a block
        engine.update(block_size=8, num_blocks=15)
    if preemption != "recompute":
        engine.update(preemption_mode=preemption, swap_space=1 << 20)
    results = {}
    for tp in [1] + [int(s) for s in sizes.split(",") if s]:
        llm = LLM(path, tensor_parallel_size=tp, **engine)
        results[tp] = workload(llm)
        results[tp]["swapped"] = llm.stats()["num_swapped_preemptions"]
    return results


def memory(kind: str, sizes: str) -> dict:
    """Bytes of params and pool on each device, from the arrays' addressable shards."""
    path = model_dir(kind)
    out = {}
    for tp in [1] + [int(s) for s in sizes.split(",")]:
        runner = LLM(path, block_size=4, num_blocks=32, tensor_parallel_size=tp).engine.runner
        per_device: dict[str, dict[int, int]] = {"params": {}, "pool": {}}
        for key, tree in (("params", runner.params), ("pool", runner.kv_pool)):
            for leaf in jax.tree.leaves(tree):
                for shard in leaf.addressable_shards:
                    d = per_device[key]
                    d[shard.device.id] = d.get(shard.device.id, 0) + shard.data.nbytes
        out[tp] = {k: sorted(v.values()) for k, v in per_device.items()}
    return out


def collectives(kind: str, tp: str) -> dict:
    """Collectives in the compiled decode and prefill steps of the sharded model."""
    from jaxpage.engine.runner import _FORWARD

    path = model_dir(kind)
    runner = LLM(path, block_size=4, num_blocks=32,
                 tensor_parallel_size=int(tp)).engine.runner
    from jaxpage.attention import build_metadata

    result = {"num_layers": runner.model.config.num_layers}
    for name, num_new in (("decode", [1, 1]), ("prefill", [9, 5])):
        positions, md = build_metadata([[1, 2, 3], [4, 5, 6]], [2, 0], num_new, 4,
                                       num_tokens=16, num_seqs=4, backend=runner.backend)
        token_ids = np.zeros(16, np.int32)
        hlo = _FORWARD.lower(runner.model, "cpu", runner.params, runner.kv_pool, token_ids,
                             positions, md).compile().as_text()
        ops = [line.split("=", 1)[1].split("(")[0].strip().split(" ")[-1]
               for line in hlo.splitlines() if "=" in line and "(" in line]
        result[name] = {op: ops.count(op) for op in ("all-reduce", "all-gather",
                                                     "all-to-all", "collective-permute",
                                                     "reduce-scatter", "all-reduce-start",
                                                     "all-gather-start")}
        # the donated pool is updated in place: every pool buffer aliases an output
        alias = next(line for line in hlo.splitlines() if "input_output_alias=" in line)
        result[name]["aliased_buffers"] = alias.split("input_output_alias=")[1].count("may-alias")
        pool_shape = runner.kv_pool[0][0].addressable_shards[0].data.shape
        result[name]["pool_copies"] = sum(
            1 for line in hlo.splitlines()
            if " copy(" in line and "[" + ",".join(map(str, pool_shape)) + "]" in line)
    return result


def data_parallel(kind: str, backend: str, dp: str, tp: str) -> dict:
    """The workload on one device and on dp replicas of tp devices each."""
    path = model_dir(kind)
    engine = dict(ENGINE_FOR_TOKENS, attention_backend=backend)
    single = workload(LLM(path, **engine))
    llm = LLM(path, data_parallel_size=int(dp), tensor_parallel_size=int(tp), **engine)
    replicated = workload(llm)
    stats = llm.stats()
    return {"single": single, "replicated": replicated,
            "replica_hits": [s["prefix_cache_hits"] for s in stats["replicas"]],
            "replica_steps": [s["num_steps"] for s in stats["replicas"]],
            "phases": stats["step_phases"], "step_seconds": stats["step_seconds"],
            "replica_phases": [s["step_phases"] for s in stats["replicas"]],
            "replica_devices": [[d.id for d in r.runner.devices]
                                for r in llm.engine.replicas]}


def export_tpu(num_layers: str) -> dict:
    """The tensor-parallel decode step at Llama-3-8B shapes (32 query / 8 KV heads,
    head_dim 128, 8k context) exported for TPU on an abstract 8-device mesh, with the Pallas
    TPU decode kernel inside: no TPU and no weights needed."""
    from jax.sharding import AbstractMesh, NamedSharding

    from jaxpage.attention import AttentionMetadata
    from jaxpage.engine.runner import _forward_fn
    from jaxpage.models.config import ModelConfig
    from jaxpage.models.llama import LlamaModel, param_shapes
    from jaxpage.parallel import MODEL_AXIS, POOL_SPEC, TensorParallel, TensorParallelModel

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=int(num_layers), num_heads=32,
                         num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
    plan = TensorParallel(AbstractMesh((8,), (MODEL_AXIS,)), config)
    model = TensorParallelModel.wrap(LlamaModel(config), plan)
    bf16, i32 = jax.numpy.bfloat16, jax.numpy.int32

    def abstract(shape, spec, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(plan.mesh, spec))

    shapes = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, bf16),
                          plan.layout_shapes(param_shapes(config)),
                          is_leaf=lambda x: isinstance(x, tuple))
    params = jax.tree.map(lambda leaf, spec: abstract(leaf.shape, spec), shapes,
                          TensorParallel.param_specs(shapes))
    rows, block_size, num_blocks, width = 64, 16, 4096, 8192 // 16
    pool = [tuple(abstract((plan.pool_kv_heads, num_blocks, block_size, 128), POOL_SPEC)
                  for _ in "kv") for _ in range(config.num_layers)]
    replicated = jax.sharding.PartitionSpec()
    md = AttentionMetadata(
        slot_mapping=abstract((rows,), replicated, i32),
        block_tables=abstract((rows, width), replicated, i32),
        seq_lens=abstract((rows,), replicated, i32),
        query_start_loc=abstract((rows + 1,), replicated, i32),
        logits_indices=abstract((rows,), replicated, i32),
        max_query_len=1, backend="pallas_tpu")
    step = jax.jit(_forward_fn, static_argnums=(0, 1), donate_argnums=3)
    exported = jax.export.export(step, platforms=["tpu"])(
        model, "tpu", params, pool, abstract((rows,), replicated, i32),
        abstract((rows,), replicated, i32), md)
    text = exported.mlir_module()
    return {"platforms": list(exported.platforms), "nr_devices": exported.nr_devices,
            "mosaic_calls": text.count("tpu_custom_call"),
            "all_reduces": text.count("stablehlo.all_reduce"),
            "all_gathers": text.count("stablehlo.all_gather"),
            "num_layers": config.num_layers}


class KnownDrafts:
    """Proposes what follows a sequence in `sequences` (the run without speculation), every
    third draft position wrong, so that steps accept all, some and none of their drafts."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def propose(self, token_ids, k):
        n = len(token_ids)
        known = next((s for s in self.sequences if len(s) > n and s[:n] == token_ids), [])
        return [t if (n + i) % 3 else (t + 1) % 97 for i, t in enumerate(known[n : n + k])]


def speculative(kind: str, sizes: str, proposer: str = "known") -> dict:
    """The tokens workload's greedy and seeded requests (chunked, preempting) with drafts
    verified on the mesh: {tp: tokens, accepted drafts}, "plain": one device without. The
    drafts are `KnownDrafts`' ("known"), or a draft model's of its own, split over the mesh
    as the target is: the target's checkpoint loaded again ("draft")."""
    path = model_dir(kind)
    prompts = [list(range(3, 8)), PREFIX + [70, 71], list(range(3, 60)), list(range(80, 90))]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(n=2, max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)]
    engine = dict(ENGINE_FOR_TOKENS, num_blocks=20)
    outs = LLM(path, **engine).generate(prompts, params, use_tqdm=False)
    results = {"plain": {"tokens": [[c.token_ids for c in o.outputs] for o in outs]}}
    known = [p + c.token_ids for p, o in zip(prompts, outs, strict=True) for c in o.outputs]
    for tp in [1] + [int(s) for s in sizes.split(",") if s]:
        spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
        if proposer == "draft":
            spec.update(method="draft_model", model=path)
        llm = LLM(path, tensor_parallel_size=tp, speculative_config=spec, **engine)
        if proposer == "known":
            llm.engine.scheduler.proposer = KnownDrafts(known)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        results[tp] = {"tokens": [[c.token_ids for c in o.outputs] for o in outs],
                       "accepted": stats["spec_decode"]["num_accepted_tokens"],
                       "preemptions": stats["num_preemptions"]}
    return results


def lora(kind: str, sizes: str) -> dict:
    """Greedy prompts under four PEFT adapters (ranks 2-16, different target modules) and the
    base model in one batch, on a pool small enough to preempt, 2 device slots (adapters
    take turns): {tp: tokens}, "base": every prompt without its adapter on one device."""
    from engine.test_lora import make_adapters

    spec = dict(MODELS[kind])
    spec.pop("name")
    hf_model = build_hf_model("llama", 0, **spec)
    path = tempfile.mkdtemp()
    hf_model.save_pretrained(path)
    adapters = make_adapters(hf_model, tempfile.mkdtemp())
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, (p, _) in enumerate(adapters)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 120, size=int(rng.integers(5, 40))).tolist() for _ in range(10)]
    loras = [None if k % 5 == 4 else requests[k % 5] for k in range(len(prompts))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = dict(ENGINE_FOR_TOKENS, num_blocks=24, enable_lora=True, max_loras=2)
    results = {"base": [o.outputs[0].token_ids for o in LLM(path, **ENGINE_FOR_TOKENS).generate(
        prompts, params, use_tqdm=False)]}
    runs = {str(tp): dict(tensor_parallel_size=tp)
            for tp in [1] + [int(s) for s in sizes.split(",") if s]}
    runs["dp2"] = dict(data_parallel_size=2)  # two replicas, each its own slots
    for name, sizes in runs.items():
        llm = LLM(path, **sizes, **engine)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        results[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                         "preemptions": llm.stats()["num_preemptions"]}
    return results


def refusals() -> dict:
    path = model_dir("llama8")
    messages = {}
    for name, sizes in (("16", (1, 16)), ("3", (1, 3)), ("5", (1, 5)), ("dp3", (3, 4))):
        try:
            LLM(path, num_blocks=8, data_parallel_size=sizes[0], tensor_parallel_size=sizes[1])
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


if __name__ == "__main__":
    if sys.argv[1] == "model_dir":  # for the multi-process test: the model both processes load
        print(json.dumps(model_dir(sys.argv[2])))
        sys.exit()
    case, *args = sys.argv[1:]
    print(json.dumps({"tokens": tokens, "memory": memory, "collectives": collectives,
                      "data_parallel": data_parallel, "export_tpu": export_tpu,
                      "refusals": refusals, "speculative": speculative,
                      "lora": lora}[case](*args)))
