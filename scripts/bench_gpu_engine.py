"""The engine end to end on one GPU against HF transformers, at Llama-3.2-1B and Llama-3-8B shapes.

    python scripts/bench_gpu_engine.py --out bench_gpu_engine.json   # both shapes, ~7 minutes
    python scripts/bench_gpu_engine.py --shapes 1b --budget-s 200    # one shape
    python scripts/bench_gpu_engine.py --skip-hf                     # jaxpage alone
    python scripts/bench_gpu_engine.py --tiny                        # CPU plumbing, ~1-2 minutes

Both engines serve the same random-weight models in bfloat16: Llama-3.2-1B's shapes (16 layers,
hidden 2048, 32 query and 8 KV heads of 64, vocabulary 128,256, tied embeddings, llama3 rope)
and Llama-3-8B's (32 layers, hidden 4096, heads of 128, untied), each an HF config dict
(`SHAPES`) from which jaxpage builds its `ModelConfig` (`ModelConfig.from_hf`) and HF its
`LlamaForCausalLM`. jaxpage's weights are drawn on the device leaf by leaf (normal, std 0.02;
norms 1) and read to the host, from where the engine loads them as it loads any checkpoint. HF
gets the same values (written per tensor to a temporary directory, split and transposed back to
HF's names on the GPU) where they take at most --share-weights-gib (the 1B), and its own random
init otherwise (the 8B: 16 GB through a file costs more than the budget allows); ignore_eos
fixes every length either way, and the output says which.

The trace (`bench_common.sharegpt_trace`): --requests requests (256) with ShareGPT-like lengths,
prompts of 50-1000 tokens (median 200), outputs of 50-400 (median 160), uniform random tokens,
all submitted at once, greedy, ignore_eos. Every request must produce exactly its tokens.

Each engine runs in a process of its own, one after another (jaxpage 1B, HF 1B, jaxpage 8B,
HF 8B), so that each has the GPU's memory to itself: JAX's allocator keeps what it took until
its process ends. This process imports neither JAX nor torch; it splits --budget-s among the
others by weight (HF's 0.7 of jaxpage's, the 8B's 1.6 times the 1B's; what one leaves unused
goes to those after it), each stops starting phases past its share and reports what it
measured, and one still running a minute past its share is ended.

jaxpage: configs/gpu.json's engine (bfloat16, the platform's attention backend, 16-token
blocks, 256 sequences, 4096 batched tokens, KV pool from 90% of free memory) with
max_model_len 2048 and prefix caching off (random prompts share no prefix, and a second run
then recomputes every prompt, as HF does); --engine-arg overrides any field. In order:

1. copy bandwidth: a jitted `x + 1` over 2 GiB, read and written (`device_copy_gbps`).
2. decode steps at --decode-batches (1, 64, 256) sequences of --decode-context (512) tokens,
   taking at most 35% of the process's time left: after two untimed steps, --decode-steps
   engine steps timed one by one (median wall), then as many under `jax.profiler`, whose
   device busy time over those steps (the union of the device plane's stream activity,
   `bench_common.profile_busy`) gives device ms per step; then the runner's jitted forward
   alone on such a step (`bench_common.forward_args`, median), a second measure of the
   device's time. The bound is the step's reads at the copy bandwidth: every weight once (an
   untied embedding only its rows) plus each sequence's K/V, (weight bytes + K/V bytes) /
   bandwidth.
3. the trace, cold (compiling every shape it meets), then warm: output tok/s is the warm run's
   output tokens over its seconds. --window-steps steps of the warm run from a third of the way
   in run under the profiler: mean step ms over that window against device busy ms per step
   over the same steps (the profiler's start and stop are taken out of the run's seconds).
   Device busy comes from the profile, not from replaying the jitted step alone. Where the
   share leaves no time for the warm run, the table gives the cold run's rate with the
   seconds spent compiling taken out, and says so.

HF transformers (`LlamaForCausalLM`, the same config, bfloat16, sdpa, on cuda): static batches
through `generate` (--hf-batch requests at a time in trace order, left-padded, each batch
running to its longest output; useful tokens are each request's own), then its continuous
batching with each request's own max_new_tokens: the manager `generate_batch` runs
(`continuous_batching_context_manager`, or `init_continuous_batching` where the installed
transformers is older; its warm-up, CUDA graph capture, is outside the timed part; reported
unavailable where the model has neither; one that fails is retried once with
auto_switch_to_flash=False, its switch to a flash attention it may not be able to load). Static
batches stop at half the process's share, continuous batching at the share (a partial run's
tok/s counts finished requests only).

It prints one table per shape (tok/s and ratio; mean step against device busy; decode steps
against the bound) and writes every figure to --out. `--tiny` runs the same plumbing on CPU on a
2-layer Llama in float32 with the 1B's tied embeddings and llama3 rope (6 requests, decode at 1
and 4 sequences): the numbers mean nothing there (on CPU the profile sees only XLA's own
threads), the tokens and lengths do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
from bench_common import (
    cores,
    decode_seqs,
    device_copy_gbps,
    forward_args,
    kv_read_bytes,
    parse_name_values,
    profile_busy,
    sharegpt_trace,
    weight_read_bytes,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
               rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_id=None,
               hidden_act="silu", attention_bias=False, mlp_bias=False)
SHAPES = {
    "1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               max_position_embeddings=131072, tie_word_embeddings=True,
               rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               max_position_embeddings=8192, tie_word_embeddings=False),
    # the 1B's features (tied embeddings, llama3 rope) at a CPU test's size
    "tiny": dict(_LLAMA3, vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=256, rope_theta=10000.0, bos_token_id=1,
                 tie_word_embeddings=True,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=32)),
}
SHAPE_NAMES = {"1b": "Llama-3.2-1B", "8b": "Llama-3-8B", "tiny": "tiny Llama"}

# the defaults on a GPU and with --tiny (CPU plumbing)
MODES = {
    "gpu": dict(requests=256, prompt_range=(50, 1000), output_range=(50, 400),
                decode_batches="1,64,256", decode_context=512, decode_steps=20, window_steps=100,
                hf_batch=64, dtype="bfloat16", init_std=0.02, copy_bytes=2 << 30, budget_s=420),
    "tiny": dict(requests=6, prompt_range=(4, 40), output_range=(3, 12), decode_batches="1,4",
                 decode_context=24, decode_steps=4, window_steps=6, hf_batch=4, dtype="float32",
                 init_std=0.1, copy_bytes=32 << 20, budget_s=600),
}
# a process's share of the budget: HF's and the 8B's larger
WEIGHTS = {"jaxpage": 1.0, "hf": 0.7}
BIG = {"8b": 1.6}
GRACE_S = 60  # past its share, a process is ended
DECODE_SHARE = 0.35  # of a jaxpage process's time left after loading, at most
MIN_SHARE_S = 20  # a process not started with less


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def engine_kwargs(tiny: bool, dtype: str, overrides: dict) -> dict:
    """The jaxpage engine's fields: configs/gpu.json's (its model aside) with max_model_len
    2048 and prefix caching off, or a tiny CPU engine's; then `overrides`."""
    if tiny:
        kwargs = dict(block_size=16, max_model_len=128, max_num_seqs=8,
                      max_num_batched_tokens=64, num_blocks=128)
    else:
        with open(os.path.join(REPO, "configs", "gpu.json")) as f:
            kwargs = {k: v for k, v in json.load(f).items() if k not in ("_comment", "model")}
        kwargs["max_model_len"] = 2048
    kwargs.update(dtype=dtype, enable_prefix_caching=False)
    kwargs.update(overrides)
    return kwargs


# --------------------------------------------------------------------- the parent

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated, of 1b, 8b")
    ap.add_argument("--requests", type=int, help="requests in the trace (256; --tiny 6)")
    ap.add_argument("--budget-s", type=float,
                    help="seconds for the whole call, split among the processes (420)")
    ap.add_argument("--skip-hf", action="store_true", help="jaxpage alone")
    ap.add_argument("--out", help="write every figure here as JSON")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU plumbing: a 2-layer float32 Llama, a handful of requests")
    ap.add_argument("--dtype", help="model dtype (bfloat16; --tiny float32)")
    ap.add_argument("--decode-batches", help="sequences per decode step (1,64,256)")
    ap.add_argument("--decode-context", type=int, help="tokens per sequence at decode (512)")
    ap.add_argument("--decode-steps", type=int, help="decode steps timed, and as many profiled")
    ap.add_argument("--window-steps", type=int, help="warm-run steps under the profiler (100)")
    ap.add_argument("--hf-batch", type=int, help="HF static batch size (64)")
    ap.add_argument("--share-weights-gib", type=float, default=4.0,
                    help="give HF jaxpage's weights where they take at most this")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="a jaxpage EngineConfig field, e.g. max_num_batched_tokens=2048")
    ap.add_argument("--hf-cb-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="a field of transformers' ContinuousBatchingConfig, where it has one")
    ap.add_argument("--profile-dir", help="keep the jax.profiler traces here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child)

    mode = MODES["tiny" if args.tiny else "gpu"]
    for name, value in mode.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    shapes = ["tiny"] if args.tiny else [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in ("1b", "8b")] if not args.tiny else []
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose among 1b, 8b")
    batches = [int(b) for b in str(args.decode_batches).split(",") if b.strip()]
    systems = ["jaxpage"] + ([] if args.skip_hf else ["hf"])
    plan = [(shape, system) for shape in shapes for system in systems]
    weights = {item: WEIGHTS[item[1]] * BIG.get(item[0], 1.0) for item in plan}

    started = time.time()
    deadline = started + args.budget_s
    meta = dict(command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                budget_s=args.budget_s, dtype=args.dtype, requests=args.requests,
                prompt_range=list(mode["prompt_range"]), output_range=list(mode["output_range"]),
                decode_batches=batches, decode_context=args.decode_context,
                hf_batch=args.hf_batch, seed=args.seed,
                busy_method="union of the device's activity in a jax.profiler trace of the "
                            "same steps (bench_common.profile_busy)")
    results: dict = {shape: {} for shape in shapes}
    traces = {}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_engine_") as tmp:
        for shape in shapes:
            prompts, output_lens = sharegpt_trace(args.requests, args.seed,
                                                  SHAPES[shape]["vocab_size"],
                                                  mode["prompt_range"], mode["output_range"])
            traces[shape] = dict(requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                                 output_tokens=sum(output_lens),
                                 output_lens=output_lens)
            with open(os.path.join(tmp, f"trace_{shape}.json"), "w") as f:
                json.dump({"prompts": prompts, "output_lens": output_lens}, f)
        for i, (shape, system) in enumerate(plan):
            remaining = deadline - time.time()
            if remaining < (1 if args.tiny else MIN_SHARE_S):
                results[shape][system] = {"skipped": f"budget spent ({remaining:.0f} s left)"}
                continue
            share = remaining * weights[(shape, system)] / sum(weights[p] for p in plan[i:])
            spec = dict(system=system, shape=shape, hf_config=SHAPES[shape], tiny=args.tiny,
                        dtype=args.dtype, seed=args.seed, deadline=time.time() + share,
                        trace=os.path.join(tmp, f"trace_{shape}.json"),
                        result=os.path.join(tmp, f"result_{shape}_{system}.json"),
                        tokens=os.path.join(tmp, f"tokens_{shape}_jaxpage.json"),
                        weights_dir=os.path.join(tmp, f"weights_{shape}"),
                        share_weights_bytes=args.share_weights_gib * 2**30,
                        init_std=mode["init_std"], copy_bytes=mode["copy_bytes"],
                        engine=engine_kwargs(args.tiny, args.dtype,
                                             parse_name_values(args.engine_arg)),
                        decode_batches=batches, decode_context=args.decode_context,
                        decode_steps=args.decode_steps, window_steps=args.window_steps,
                        hf_batch=args.hf_batch, hf_cb_args=parse_name_values(args.hf_cb_arg),
                        profile_dir=os.path.join(os.path.abspath(args.profile_dir or tmp),
                                                 f"profile_{shape}"))
            log(f"{SHAPE_NAMES[shape]}: {system} in its own process, {share:.0f} s of "
                f"{remaining:.0f} s left")
            results[shape][system] = run_child(spec, tmp, share + GRACE_S)
    meta["seconds"] = time.time() - started
    summary = {shape: summarize(results[shape], traces[shape]) for shape in shapes}
    print_tables(shapes, results, summary, traces, meta)
    if args.out:
        out = dict(meta=meta, trace={s: {k: v for k, v in t.items() if k != "output_lens"}
                                     for s, t in traces.items()},
                   summary=summary, results=results)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    failed = [f"{shape} {system}" for shape in shapes for system, r in results[shape].items()
              if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def run_child(spec: dict, tmp: str, timeout: float) -> dict:
    """Run one engine's process on `spec`; its result (what it wrote, phase by phase), with
    how it ended."""
    path = os.path.join(tmp, f"spec_{spec['shape']}_{spec['system']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    if spec["system"] == "hf":
        env["JAX_PLATFORMS"] = "cpu"  # should anything import JAX there, it leaves the GPU be
    start = time.time()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", path],
                            env=env, cwd=REPO)
    killed = False
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        killed = True
    result = {}
    if os.path.exists(spec["result"]):
        with open(spec["result"]) as f:
            result = json.load(f)
    result["process_s"] = time.time() - start
    result["exit_code"] = code
    if killed:
        result["killed"] = f"ended {timeout:.0f} s after it started (its share + {GRACE_S} s)"
    elif code and "error" not in result:
        result["error"] = f"exited with {code}"
    return result


# --------------------------------------------------------------------- one engine's process

def child_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict = {"system": spec["system"], "shape": spec["shape"]}

    def save() -> None:
        with open(spec["result"] + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(spec["result"] + ".tmp", spec["result"])

    try:
        (run_jaxpage if spec["system"] == "jaxpage" else run_hf)(spec, result, save)
    except Exception as error:
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {str(error)[:1000]}"
        save()
        return 1
    save()
    return 0


def load_trace(spec: dict) -> tuple[list, list]:
    with open(spec["trace"]) as f:
        trace = json.load(f)
    return trace["prompts"], trace["output_lens"]


def param_names(config) -> list[tuple[str, tuple]]:
    """(name, shape) of every param: "embed", "layers.N.qkv", ..., "final_norm", "lm_head"."""
    from jaxpage.models.llama import param_shapes

    shapes = param_shapes(config)
    names = [("embed", shapes["embed"])]
    for n, layer in enumerate(shapes["layers"]):
        names += [(f"layers.{n}.{k}", shape) for k, shape in layer.items()]
    names.append(("final_norm", shapes["final_norm"]))
    if "lm_head" in shapes:
        names.append(("lm_head", shapes["lm_head"]))
    return names


def random_params(config, dtype: str, std: float, seed: int) -> dict:
    """Every param by name, drawn on the default device one at a time (normal * `std`;
    vectors, the norms, 1) and read to the host, the device copy freed at once."""
    import jax
    import jax.numpy as jnp

    np_dtype = jnp.dtype(dtype)
    draw = jax.jit(lambda key, shape: (std * jax.random.normal(key, shape, jnp.float32)
                                       ).astype(np_dtype), static_argnums=1)
    key = jax.random.key(seed)
    flat = {}
    for i, (name, shape) in enumerate(param_names(config)):
        if len(shape) == 1:
            flat[name] = np.ones(shape, np_dtype)
            continue
        x = draw(jax.random.fold_in(key, i), tuple(shape))
        flat[name] = np.asarray(x)
        x.delete()
    return flat


def params_tree(flat: dict, num_layers: int) -> dict:
    """jaxpage's params pytree from `random_params`' names."""
    layers = [{} for _ in range(num_layers)]
    tree = {"layers": layers}
    for name, value in flat.items():
        if name.startswith("layers."):
            _, n, key = name.split(".")
            layers[int(n)][key] = value
        else:
            tree[name] = value
    return tree


def save_weights(flat: dict, directory: str) -> None:
    """Each param as a .npy (bfloat16 as its int16 bits) and a manifest of their dtype."""
    os.makedirs(directory, exist_ok=True)
    dtype = str(next(iter(flat.values())).dtype)
    for name, value in flat.items():
        np.save(os.path.join(directory, name + ".npy"),
                value.view(np.int16) if dtype == "bfloat16" else value)
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump({"dtype": dtype, "names": list(flat)}, f)


class Profile:
    """A window of steps under `jax.profiler`: its wall seconds (between the trace's start and
    stop), the seconds the start and stop themselves took, and the device's busy time."""

    def __init__(self, directory: str) -> None:
        import jax

        self.directory, self.error, self.overhead_s = directory, None, 0.0
        self.active, self.started = False, None
        self.host_fallback = jax.default_backend() == "cpu"

    def start(self) -> None:
        import jax

        os.makedirs(self.directory, exist_ok=True)
        begin = time.perf_counter()
        try:
            jax.profiler.start_trace(self.directory)
            self.active = True
        except Exception as error:  # no profiler here: the window is timed all the same
            self.error = f"{type(error).__name__}: {error}"
        self.started = time.perf_counter()
        self.overhead_s += self.started - begin

    def stop(self, steps: int) -> dict:
        import jax

        wall = time.perf_counter() - self.started
        begin = time.perf_counter()
        busy: dict = {"busy_s": None, "error": self.error}
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            try:
                busy = profile_busy(self.directory, self.host_fallback)
            except Exception as error:
                busy = {"busy_s": None, "error": f"{type(error).__name__}: {error}"}
        self.overhead_s += time.perf_counter() - begin
        window = dict(steps=steps, wall_s=wall, mean_step_ms=wall / max(steps, 1) * 1e3, **busy)
        if busy.get("busy_s") is not None and steps:
            window["device_ms_per_step"] = busy["busy_s"] / steps * 1e3
            window["busy_share"] = busy["busy_s"] / wall
            window["kernel_busy_share"] = busy["kernel_busy_s"] / wall
        return window


def add_requests(engine, tag: str, prompts: list, output_lens: list) -> list[str]:
    from jaxpage import SamplingParams

    ids = []
    for i, (prompt, n) in enumerate(zip(prompts, output_lens, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt,
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        ids.append(f"{tag}-{i}")
    return ids


class Outputs:
    """Each request's tokens so far and finish reason, from the engine's step deltas."""

    def __init__(self) -> None:
        self.merged: dict = {}
        self.finished: dict = {}

    def add(self, outs) -> None:
        from jaxpage.llm import merge_delta

        for out in outs:
            completions = merge_delta(self.merged.setdefault(out.request_id, {}), out)
            if out.finished:
                self.finished[out.request_id] = completions[0]

    def tokens(self, request_id: str) -> list[int]:
        merged = self.merged.get(request_id, {})
        return list(merged[0].token_ids) if 0 in merged else []

    def generated(self) -> int:
        return sum(len(self.tokens(r)) for r in self.merged)


def end_requests(engine, ids: list[str], outputs: Outputs) -> None:
    """Abort whatever of `ids` is unfinished and step until the engine holds nothing."""
    for request_id in ids:
        if request_id not in outputs.finished:
            engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        outputs.add(engine.step())


def engine_counters(llm) -> dict:
    stats = llm.stats()
    return {k: stats.get(k) for k in ("compiles", "compile_seconds", "num_steps",
                                       "num_preemptions", "kv_peak_usage")}


WARMUP_STEPS = 2  # decode steps before the timed ones: a new shape compiles in the first


def decode_phase(llm, config, spec: dict, batch: int, copy_gbps: float, rng,
                 deadline: float) -> dict:
    """Decode steps of `batch` sequences at the decode context: wall per engine step, device
    busy per step under the profiler, the jitted forward alone, and the read bound."""
    import jax.numpy as jnp

    engine, context = llm.engine, spec["decode_context"]
    steps, window = spec["decode_steps"], spec["decode_steps"]
    prompts = [rng.integers(0, config.vocab_size, context).tolist() for _ in range(batch)]
    ids = add_requests(engine, f"decode{batch}", prompts,
                       [WARMUP_STEPS + steps + window + 4] * batch)
    outputs = Outputs()
    record: dict = dict(batch=batch, context=context)
    start = time.perf_counter()
    try:
        prefill_steps = 0
        while any(not outputs.tokens(r) for r in ids):  # every prompt through: all decode
            if time.time() > deadline:
                record["incomplete"] = "budget spent during the prompts"
                return record
            outputs.add(engine.step())
            prefill_steps += 1
        record.update(prefill_steps=prefill_steps, prefill_s=time.perf_counter() - start)
        for _ in range(WARMUP_STEPS):
            outputs.add(engine.step())
        walls = []
        for _ in range(steps):
            begin = time.perf_counter()
            outputs.add(engine.step())
            walls.append(time.perf_counter() - begin)
        profile = Profile(os.path.join(spec["profile_dir"], f"decode_{batch}"))
        profile.start()
        for _ in range(window):
            outputs.add(engine.step())
        record["window"] = profile.stop(window)
    finally:
        end_requests(engine, ids, outputs)
    record.update(forward_alone(llm, batch, context + 2 + steps + window // 2, steps))
    itemsize = jnp.dtype(spec["engine"]["dtype"]).itemsize
    kv_dtype = spec["engine"].get("kv_cache_dtype", "auto")
    kv_itemsize = itemsize if kv_dtype == "auto" else jnp.dtype(kv_dtype).itemsize
    # the K/V a timed step reads on average, its own token's included: the first reads the
    # prompt, the first token and the warm-up steps' tokens, and its own
    mean_context = context + 1 + WARMUP_STEPS + (steps + window - 1) / 2
    weight_bytes = weight_read_bytes(config, itemsize, batch)
    kv_bytes = kv_read_bytes(config, kv_itemsize, batch, mean_context)
    bound_ms = (weight_bytes + kv_bytes) / (copy_gbps * 1e9) * 1e3
    wall_ms = float(np.median(walls)) * 1e3
    record.update(wall_ms=wall_ms, wall_ms_mean=float(np.mean(walls)) * 1e3,
                  weight_bytes=weight_bytes, kv_bytes=kv_bytes, bound_ms=bound_ms,
                  wall_over_bound=wall_ms / bound_ms)
    device_ms = record["window"].get("device_ms_per_step")
    if device_ms is not None:
        record.update(device_ms=device_ms, device_over_bound=device_ms / bound_ms)
    return record


def forward_alone(llm, batch: int, context: int, runs: int) -> dict:
    """Median ms of the runner's jitted forward alone on a decode step of `batch` sequences
    at `context` (its arguments caught by `bench_common.forward_args`, the live pool handed in
    each time): a second measure of the device's time beside the profile's, or the reason
    the runner offers none."""
    import jax

    from jaxpage.engine import runner as runner_module

    try:
        runner = llm.engine.runner
        args = list(forward_args(runner, decode_seqs(runner, batch, context)))
        times = []
        for _ in range(runs + 1):
            args[3] = runner.kv_pool
            begin = time.perf_counter()
            logits, runner.kv_pool = runner_module._FORWARD(*args)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - begin)
        return {"forward_alone_ms": float(np.median(times[1:])) * 1e3}
    except Exception as error:  # a runner laid out otherwise: the profile's figure stands
        return {"forward_alone_error": f"{type(error).__name__}: {str(error)[:300]}"}


def trace_run(llm, prompts: list, output_lens: list, tag: str, deadline: float,
              window: tuple[int, int] | None = None, profile_dir: str | None = None) -> tuple:
    """The trace through the engine, every request added at once: (record, tokens per
    request). With `window` (first step, steps) those steps run under the profiler, whose start
    and stop are taken out of the run's seconds. Past `deadline` the rest is aborted."""
    engine = llm.engine
    before = engine_counters(llm)
    ids = add_requests(engine, tag, prompts, output_lens)
    outputs, step_s, profile, record, compiles = Outputs(), [], None, {}, 0

    def close_window(steps: int) -> None:  # a compile in the window weighs on its mean step
        record["window"] = profile.stop(steps)
        record["window"]["compiles"] = (llm.stats().get("compiles") or 0) - compiles

    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if time.time() > deadline:
            record["incomplete"] = "budget spent"
            break
        if window and len(step_s) == window[0]:
            compiles = llm.stats().get("compiles") or 0
            profile = Profile(profile_dir)
            profile.start()
        begin = time.perf_counter()
        outputs.add(engine.step())
        step_s.append(time.perf_counter() - begin)
        if profile is not None and "window" not in record and (
                len(step_s) == window[0] + window[1]):
            close_window(window[1])
    if profile is not None and "window" not in record:  # the run ended inside the window
        close_window(len(step_s) - window[0])
    seconds = time.perf_counter() - start - (profile.overhead_s if profile else 0.0)
    generated = outputs.generated()
    end_requests(engine, ids, outputs)
    after = engine_counters(llm)
    produced = [len(outputs.tokens(r)) for r in ids]
    finished = [r for r in ids if r in outputs.finished
                and outputs.finished[r].finish_reason == "length"]
    record.update(
        seconds=seconds, steps=len(step_s), requests=len(ids), finished_requests=len(finished),
        output_tokens=generated, tok_s=generated / seconds if seconds > 0 else None,
        mean_step_ms=float(np.mean(step_s)) * 1e3 if step_s else None,
        # every finished request has exactly its tokens (a complete run: every request)
        lengths_ok=all(p == n for r, p, n in zip(ids, produced, output_lens, strict=True)
                       if r in outputs.finished),
        produced_tokens=produced,
        complete="incomplete" not in record,
        compiles=(after["compiles"] or 0) - (before["compiles"] or 0),
        compile_s=(after["compile_seconds"] or 0) - (before["compile_seconds"] or 0),
        preemptions=(after["num_preemptions"] or 0) - (before["num_preemptions"] or 0),
        kv_peak_usage=after["kv_peak_usage"])
    # compiling blocks the step that meets a new shape: its seconds (and that call's run)
    # taken out, for a run that had no time to be repeated warm
    rest = seconds - record["compile_s"]
    record["tok_s_without_compiles"] = generated / rest if rest > 0 else None
    return record, [outputs.tokens(r) for r in ids]


def run_jaxpage(spec: dict, result: dict, save) -> None:
    import jax

    from jaxpage import LLM
    from jaxpage.models.config import ModelConfig
    from jaxpage.models.llama import LlamaModel

    device = jax.devices()[0]
    result.update(jax_version=jax.__version__, backend=jax.default_backend(),
                  device=device.device_kind, python=sys.version.split()[0])
    if result["backend"] == "cpu" and not spec["tiny"]:
        raise RuntimeError("no accelerator: JAX runs on cpu (--tiny runs the plumbing there)")
    config = ModelConfig.from_hf(spec["hf_config"])
    deadline = spec["deadline"]
    log(f"jaxpage {spec['shape']}: drawing random weights on {device.device_kind}")
    start = time.perf_counter()
    flat = random_params(config, spec["dtype"], spec["init_std"], spec["seed"])
    param_bytes = sum(a.nbytes for a in flat.values())
    result.update(weights_s=time.perf_counter() - start, param_bytes=param_bytes)
    if param_bytes <= spec["share_weights_bytes"]:
        start = time.perf_counter()
        save_weights(flat, spec["weights_dir"])
        result["weights_written_s"] = time.perf_counter() - start
    result["copy_gbps"] = device_copy_gbps(spec["copy_bytes"])
    log(f"jaxpage {spec['shape']}: {param_bytes / 2**30:.2f} GiB of weights in "
        f"{result['weights_s']:.1f} s; copy bandwidth {result['copy_gbps']:.0f} GB/s")
    save()
    start = time.perf_counter()
    llm = LLM(LlamaModel(config), params=params_tree(flat, config.num_layers), **spec["engine"])
    del flat
    stats = llm.stats()
    result.update(engine=spec["engine"], engine_init_s=time.perf_counter() - start,
                  attention_backend=llm.attention_backend,
                  kv_blocks=stats.get("kv_blocks_total"), decode=[])
    save()

    rng = np.random.default_rng(spec["seed"] + 1)
    # the decode steps take at most DECODE_SHARE of what is left; the trace the rest
    decode_deadline = time.time() + DECODE_SHARE * (deadline - time.time())
    for batch in spec["decode_batches"]:
        if time.time() > decode_deadline:
            result.setdefault("skipped", []).append(f"decode at {batch}")
            continue
        record = decode_phase(llm, config, spec, batch, result["copy_gbps"], rng,
                              decode_deadline)
        result["decode"].append(record)
        if "wall_ms" in record:
            log(f"jaxpage {spec['shape']}: decode at {batch}: {record['wall_ms']:.2f} ms a step, "
                f"device {record.get('device_ms', float('nan')):.2f} ms, bound "
                f"{record['bound_ms']:.2f} ms")
        save()

    prompts, output_lens = load_trace(spec)
    tokens = None
    for name in ("cold", "warm"):
        if time.time() > deadline or (name == "warm"
                                      and not result.get("cold", {}).get("complete")):
            result.setdefault("skipped", []).append(f"{name} trace run")
            continue
        window = None
        if name == "warm":
            first = max(1, result["cold"]["steps"] // 3)
            window = (first, min(spec["window_steps"], result["cold"]["steps"] - first))
        log(f"jaxpage {spec['shape']}: the trace, {name}")
        record, tokens = trace_run(llm, prompts, output_lens, name, deadline, window,
                                   os.path.join(spec["profile_dir"], "trace"))
        result[name] = record
        log(f"jaxpage {spec['shape']}: {name} run {record['seconds']:.1f} s, "
            f"{record['tok_s'] or 0:.0f} output tok/s, {record['steps']} steps, "
            f"{record['compiles']} compiles ({record['compile_s']:.1f} s)")
        save()
    if tokens is not None:
        with open(spec["tokens"], "w") as f:
            json.dump(tokens, f)


# --------------------------------------------------------------------- HF transformers

def hf_model(hf_config: dict, dtype, device):
    """HF's LlamaForCausalLM of `hf_config`, its weights made in `dtype` on `device` (HF's
    random init), sdpa attention, no EOS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hf_config)
    theta, scaling = cfg.pop("rope_theta", 10000.0), cfg.pop("rope_scaling", None)
    config = LlamaConfig(**cfg)
    rope = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    if hasattr(config, "rope_parameters"):  # transformers >= 5
        config.rope_parameters = rope
    else:
        config.rope_theta, config.rope_scaling = theta, scaling
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def load_shared_weights(model, directory: str, hf_config: dict) -> None:
    """jaxpage's params (`save_weights`) into HF's: q/k/v and gate/up split, [in, out]
    transposed to nn.Linear's [out, in]."""
    import torch

    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    device = next(model.parameters()).device

    def get(name: str):
        tensor = torch.from_numpy(np.load(os.path.join(directory, name + ".npy")))
        if manifest["dtype"] == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tensor.to(device)

    head_dim = hf_config["head_dim"]
    q = hf_config["num_attention_heads"] * head_dim
    kv = hf_config["num_key_value_heads"] * head_dim
    inter = hf_config["intermediate_size"]
    own = dict(model.named_parameters())
    with torch.no_grad():
        own["model.embed_tokens.weight"].copy_(get("embed"))
        own["model.norm.weight"].copy_(get("final_norm"))
        if "lm_head.weight" in own and not hf_config["tie_word_embeddings"]:
            own["lm_head.weight"].copy_(get("lm_head").t())
        for n in range(hf_config["num_hidden_layers"]):
            p, j = f"model.layers.{n}.", f"layers.{n}."
            qkv, gate_up = get(j + "qkv"), get(j + "gate_up")
            for name, part in (("q_proj", qkv[:, :q]), ("k_proj", qkv[:, q:q + kv]),
                               ("v_proj", qkv[:, q + kv:])):
                own[p + f"self_attn.{name}.weight"].copy_(part.t())
            own[p + "self_attn.o_proj.weight"].copy_(get(j + "o").t())
            own[p + "mlp.gate_proj.weight"].copy_(gate_up[:, :inter].t())
            own[p + "mlp.up_proj.weight"].copy_(gate_up[:, inter:].t())
            own[p + "mlp.down_proj.weight"].copy_(get(j + "down").t())
            own[p + "input_layernorm.weight"].copy_(get(j + "attn_norm"))
            own[p + "post_attention_layernorm.weight"].copy_(get(j + "mlp_norm"))


def hf_static(model, prompts: list, output_lens: list, batch: int, deadline: float) -> tuple:
    """Static batches through `generate`, in trace order, left-padded, each to its longest
    output; stops before a batch that would end past `deadline` (by the last one's time)."""
    import torch

    device = next(model.parameters()).device
    tokens: list = [None] * len(prompts)
    done, last, generated = 0, 0.0, 0
    start = time.perf_counter()
    for b in range(0, len(prompts), batch):
        if b and time.time() + last > deadline:
            break
        rows = prompts[b:b + batch]
        longest, new = max(map(len, rows)), max(output_lens[b:b + batch])
        ids = torch.zeros((len(rows), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, prompt in enumerate(rows):
            ids[r, longest - len(prompt):] = torch.tensor(prompt)
            mask[r, longest - len(prompt):] = 1
        begin = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
        out = out[:, longest:].cpu()
        last = time.perf_counter() - begin
        if out.shape[1] != new:
            raise RuntimeError(f"HF generate made {out.shape[1]} tokens, {new} asked")
        for r in range(len(rows)):
            tokens[b + r] = out[r, :output_lens[b + r]].tolist()
        done, generated = b + len(rows), generated + new * len(rows)
    seconds = time.perf_counter() - start
    useful = sum(output_lens[:done])
    return dict(seconds=seconds, batch=batch, requests=done, complete=done == len(prompts),
                output_tokens=useful, generated_tokens=generated,
                tok_s=useful / seconds if done else None,
                produced_tokens=[len(t) for t in tokens[:done]],
                lengths_ok=[len(t) for t in tokens[:done]] == output_lens[:done]), tokens


def cb_config(cb_args: dict, tiny: bool, generation_config):
    """transformers' ContinuousBatchingConfig of `cb_args` (a tiny cache on CPU: its default
    sizes for memory would take minutes there), its unknown fields dropped; None where the
    installed transformers has no such class (older ones read the sizes off the generation
    config, where they are set instead)."""
    import inspect

    args = dict(page_size=16, num_blocks=64, max_batch_tokens=128) if tiny else {}
    args.update(cb_args)
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        for name, value in args.items():
            setattr(generation_config, "block_size" if name == "page_size" else name, value)
        return None
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    return ContinuousBatchingConfig(**{k: v for k, v in args.items() if k in fields}) \
        if args else None


def hf_continuous(model, prompts: list, output_lens: list, deadline: float, cb_args: dict,
                  tiny: bool) -> tuple:
    """HF's continuous batching, each request with its own max_new_tokens; the timed part
    starts once the manager runs (after its warm-up) and ends at the last result."""
    import inspect

    import transformers
    from transformers import GenerationConfig

    if hasattr(model, "continuous_batching_context_manager"):
        api = "continuous_batching_context_manager"
    elif hasattr(model, "init_continuous_batching"):
        api = "init_continuous_batching"
    else:
        return {"unavailable": f"transformers {transformers.__version__} has no continuous "
                               "batching"}, None
    config = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens),
                              eos_token_id=None, pad_token_id=0)
    cb = cb_config(cb_args, tiny, config)
    hints = None  # what `generate_batch` tells the manager of its workload, where it can
    with contextlib.suppress(ImportError, AttributeError):
        from transformers.generation.continuous_batching import continuous_api

        hints = continuous_api.WorkloadHints(
            max_prompt_length=max(map(len, prompts)),
            max_generated_length=max(output_lens), num_requests=len(prompts))

    @contextlib.contextmanager
    def manager_running():
        if api == "continuous_batching_context_manager":
            accepted = inspect.signature(model.continuous_batching_context_manager).parameters
            kwargs = {k: v for k, v in dict(generation_config=config, block=True, timeout=10,
                                            continuous_batching_config=cb,
                                            workload_hints=hints).items()
                      if k in accepted and v is not None}
            with model.continuous_batching_context_manager(**kwargs) as manager:
                yield manager
        else:
            manager = model.init_continuous_batching(generation_config=config)
            manager.start()
            try:
                yield manager
            finally:
                manager.stop(block=True, timeout=10)

    def finished(out) -> bool:
        if callable(getattr(out, "is_finished", None)):
            return out.is_finished()
        return getattr(getattr(out, "status", None), "name", "") == "FINISHED"

    setup = time.perf_counter()
    done, record = {}, {"api": api}
    with manager_running() as manager:
        record["setup_s"] = time.perf_counter() - setup
        record["attention"] = model.config._attn_implementation
        start = end = time.perf_counter()
        ids = [f"r{i}" for i in range(len(prompts))]
        for request_id, prompt, n in zip(ids, prompts, output_lens, strict=True):
            if manager.add_request(prompt, request_id=request_id, max_new_tokens=n) is None:
                raise RuntimeError(f"HF continuous batching dropped request {request_id}")
        while len(done) < len(ids):
            if time.time() > deadline:
                record["incomplete"] = "budget spent"
                break
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing")
                continue
            if finished(out):
                if getattr(out, "error", None):
                    raise RuntimeError(f"HF continuous batching: {out.error}")
                done[out.request_id] = list(out.generated_tokens)
                end = time.perf_counter()
    seconds = end - start
    tokens = [done.get(r) for r in ids]
    useful = sum(len(t) for t in tokens if t is not None)
    record.update(seconds=seconds, requests=len(done), complete=len(done) == len(ids),
                  output_tokens=useful, tok_s=useful / seconds if done else None,
                  produced_tokens=[len(t) if t is not None else None for t in tokens],
                  lengths_ok=all(len(t) == n for t, n in zip(tokens, output_lens, strict=True)
                                 if t is not None))
    return record, tokens


def agreement(ours: list, theirs: list) -> dict:
    """How many requests two engines gave identical tokens, and the same first token."""
    pairs = [(a, b) for a, b in zip(ours, theirs, strict=True) if a is not None and b is not None]
    return dict(compared=len(pairs), identical=sum(a == b for a, b in pairs),
                same_first_token=sum(a[:1] == b[:1] for a, b in pairs))


def run_hf(spec: dict, result: dict, save) -> None:
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    cuda = torch.cuda.is_available() and not spec["tiny"]
    result.update(transformers_version=transformers.__version__, torch_version=torch.__version__,
                  device=torch.cuda.get_device_name() if cuda else "cpu",
                  has_generate_batch=hasattr(LlamaForCausalLM, "generate_batch"))
    if not cuda and not spec["tiny"]:
        raise RuntimeError("no CUDA device for torch (--tiny runs the plumbing on CPU)")
    if not cuda:
        torch.set_num_threads(cores())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, spec["dtype"])
    start = time.perf_counter()
    model = hf_model(spec["hf_config"], dtype, device)
    shared = os.path.exists(os.path.join(spec["weights_dir"], "manifest.json"))
    if shared:
        load_shared_weights(model, spec["weights_dir"], spec["hf_config"])
    result.update(weights="jaxpage's (the same values)" if shared else "random (HF's init)",
                  model_s=time.perf_counter() - start, attention=model.config._attn_implementation)
    log(f"HF {spec['shape']}: model on {result['device']} in {result['model_s']:.1f} s, "
        f"weights {result['weights']}")
    save()
    prompts, output_lens = load_trace(spec)
    ours = None  # jaxpage's tokens, compared where HF has its weights
    if shared and os.path.exists(spec["tokens"]):
        with open(spec["tokens"]) as f:
            ours = json.load(f)
    with torch.no_grad():  # the first CUDA kernels and handles, outside the timed part
        model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    deadline = spec["deadline"]
    half = time.time() + (deadline - time.time()) / 2
    log(f"HF {spec['shape']}: static batches of {spec['hf_batch']}")
    record, tokens = hf_static(model, prompts, output_lens, spec["hf_batch"], half)
    if ours is not None:
        record["agreement_with_jaxpage"] = agreement(ours[:record["requests"]],
                                                     tokens[:record["requests"]])
    result["static"] = record
    log(f"HF {spec['shape']}: static {record['requests']} requests in {record['seconds']:.1f} s,"
        f" {record['tok_s'] or 0:.0f} output tok/s")
    save()
    log(f"HF {spec['shape']}: continuous batching")
    cb_args, first_error = dict(spec["hf_cb_args"]), None
    while True:
        try:
            record, tokens = hf_continuous(model, prompts, output_lens, deadline, cb_args,
                                           spec["tiny"])
        except Exception as error:  # its failure is a result; the static column stands
            traceback.print_exc()
            record = {"error": f"{type(error).__name__}: {str(error)[:1000]}"}
            tokens = None
            # its switch to a flash attention it then cannot load (no network) is retried
            # on sdpa once
            if "auto_switch_to_flash" not in cb_args and time.time() < deadline:
                first_error, cb_args["auto_switch_to_flash"] = record["error"], False
                continue
        break
    if first_error is not None:
        record.update(first_error=first_error, retried_with={"auto_switch_to_flash": False})
    if ours is not None and tokens is not None:
        record["agreement_with_jaxpage"] = agreement(ours, tokens)
    result["continuous"] = record
    if "tok_s" in record:
        log(f"HF {spec['shape']}: continuous {record['requests']} requests in "
            f"{record['seconds']:.1f} s, {record['tok_s'] or 0:.0f} output tok/s")
    save()


# --------------------------------------------------------------------- the table

def summarize(result: dict, trace: dict) -> dict:
    """A shape's headline figures: tok/s of each, jaxpage's over HF's best, the warm run's
    window, the decode steps."""
    ours, hf = result.get("jaxpage", {}), result.get("hf", {})
    run = ours.get("warm") or ours.get("cold")
    summary: dict = dict(jaxpage_run="warm" if ours.get("warm") else "cold" if run else None)
    # a cold run alone: its rate with the compiling seconds taken out
    summary["jaxpage_tok_s"] = run.get(
        "tok_s" if ours.get("warm") else "tok_s_without_compiles") if run else None
    summary["jaxpage_complete"] = run.get("complete") if run else None
    summary["lengths_ok"] = bool(run and run.get("lengths_ok"))
    for name in ("static", "continuous"):
        record = hf.get(name, {})
        summary[f"hf_{name}_tok_s"] = record.get("tok_s")
        summary[f"hf_{name}_complete"] = record.get("complete")
        summary[f"hf_{name}_lengths_ok"] = record.get("lengths_ok")
    best = max((summary[f"hf_{n}_tok_s"] or 0 for n in ("static", "continuous")), default=0)
    summary["ratio_to_best_hf"] = summary["jaxpage_tok_s"] / best if (
        best and summary["jaxpage_tok_s"]) else None
    window = (ours.get("warm") or {}).get("window") or {}
    summary["mean_step_ms"] = window.get("mean_step_ms")
    summary["device_ms_per_step"] = window.get("device_ms_per_step")
    summary["busy_share"] = window.get("busy_share")
    summary["decode"] = {r["batch"]: {k: r.get(k) for k in (
        "wall_ms", "device_ms", "forward_alone_ms", "bound_ms", "wall_over_bound",
        "device_over_bound")}
        | {"busy_share": (r.get("window") or {}).get("busy_share")}
        for r in ours.get("decode", [])}
    summary["hf_weights"] = hf.get("weights")
    summary["requests"] = trace["requests"]
    return summary


def fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_tables(shapes: list, results: dict, summary: dict, traces: dict, meta: dict) -> None:
    devices = {r.get("device") for shape in shapes for r in results[shape].values()
               if r.get("device")}
    print(f"\nbench_gpu_engine: {', '.join(sorted(devices)) or 'no device reported'}, "
          f"{meta['dtype']}, {meta['seconds']:.0f} s")
    for shape in shapes:
        s, t, ours = summary[shape], traces[shape], results[shape].get("jaxpage", {})
        hf = results[shape].get("hf", {})
        print(f"\n{SHAPE_NAMES[shape]}: {t['requests']} requests, {t['prompt_tokens']} prompt "
              f"and {t['output_tokens']} output tokens; copy bandwidth "
              f"{fmt(ours.get('copy_gbps'), '.0f')} GB/s; attention "
              f"{ours.get('attention_backend', '-')}; HF weights {s['hf_weights'] or '-'}")
        notes = []
        if s["jaxpage_run"] == "cold":
            notes.append("jaxpage: its cold run alone, compile seconds taken out")
        for name, key in (("jaxpage", "jaxpage_complete"), ("HF static", "hf_static_complete"),
                          ("HF cont.", "hf_continuous_complete")):
            if s.get(key) is False:
                notes.append(f"{name}: partial")
        unavailable = (hf.get("continuous") or {}).get("unavailable") or (
            hf.get("continuous") or {}).get("error")
        if unavailable:
            notes.append(f"HF cont.: {unavailable[:80]}")
        print(f"  {'jaxpage tok/s':>14} {'HF static':>10} {'HF cont.':>10} {'jaxpage/best HF':>16}"
              f"  lengths")
        lengths = "ok" if s["lengths_ok"] else "WRONG" if s["jaxpage_tok_s"] else "-"
        print(f"  {fmt(s['jaxpage_tok_s'], '.0f'):>14} {fmt(s['hf_static_tok_s'], '.0f'):>10} "
              f"{fmt(s['hf_continuous_tok_s'], '.0f'):>10} "
              f"{fmt(s['ratio_to_best_hf'], '.2f', 'x'):>16}  {lengths}"
              + (f"   ({'; '.join(notes)})" if notes else ""))
        if s["mean_step_ms"] is not None:
            window = ours["warm"]["window"]
            compiled = f", {window['compiles']} compiles in it" if window.get("compiles") else ""
            print(f"  warm run, {window['steps']} steps under the profiler{compiled}: mean step "
                  f"{s['mean_step_ms']:.2f} ms, device busy {fmt(s['device_ms_per_step'], '.2f')}"
                  f" ms ({fmt(s['busy_share'] and 100 * s['busy_share'], '.0f', '%')}; "
                  f"{window.get('source') or window.get('error') or ''})")
        if ours.get("decode"):
            print(f"  decode at {ours['decode'][0]['context']} tokens: {'seqs':>5} "
                  f"{'step ms':>8} {'device':>8} {'forward':>8} {'bound':>8} {'x bound':>8} "
                  f"{'dev x b':>8} {'busy':>5}")
            for batch, d in s["decode"].items():
                print(f"  {'':>24}{batch:>5} {fmt(d['wall_ms'], '.2f'):>8} "
                      f"{fmt(d['device_ms'], '.2f'):>8} {fmt(d['forward_alone_ms'], '.2f'):>8} "
                      f"{fmt(d['bound_ms'], '.2f'):>8} "
                      f"{fmt(d['wall_over_bound'], '.2f', 'x'):>8} "
                      f"{fmt(d['device_over_bound'], '.2f', 'x'):>8} "
                      f"{fmt(d['busy_share'] and 100 * d['busy_share'], '.0f', '%'):>5}")
        for system, r in results[shape].items():
            for key in ("error", "killed", "skipped"):
                if r.get(key):
                    print(f"  {system} {key}: {r[key]}")


if __name__ == "__main__":
    sys.exit(main())
