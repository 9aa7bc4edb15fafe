"""Compiled steps kept on disk (`jaxpage.engine.executables`): a restart loads every step it
compiled before without tracing the model, and serves exactly what the jit path serves.

The oracle is the engine without the store (its jit path, which the rest of the suite holds
to HF transformers): the same tokens and log-probabilities, bit for bit, in a process that
compiled and wrote each step and in a later one that only read them. The store's key is
checked directly: a shape, a static argument or the context changed is a miss, new values
of the same shapes a hit; a damaged entry is compiled again."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.engine.executables import ExecutableStore, context_digest

WORKER = Path(__file__).with_name("executable_worker.py")


def start(model_dir: str, cache_dir: str, *flags: str) -> dict:
    """One engine start in its own process (executable_worker.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    result = subprocess.run([sys.executable, str(WORKER), model_dir, cache_dir, *flags],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 45-55 s of the default suite on 2 cores; the warm-up restart test stays
def test_a_restart_loads_every_step_and_serves_what_the_jit_path_serves(hf_model_dir, tmp_path):
    model_dir, _ = hf_model_dir("llama")
    plain = start(model_dir, "")  # no store: the jit path
    assert plain["loaded"] is None and plain["traces"] > 0
    # JAX's own cache already holds every step when the store is first filled: an executable
    # JAX loads from its cache would serialize without its compiled functions
    jax_only = start(model_dir, str(tmp_path / "cache"), "--jax-cache-only")
    assert jax_only["tokens"] == plain["tokens"] and jax_only["loaded"] is None
    first = start(model_dir, str(tmp_path / "cache"))
    assert first["tokens"] == plain["tokens"]
    assert first["compiles"] == plain["compiles"] == first["saved"] > 10
    assert first["loaded"] == 0
    restart = start(model_dir, str(tmp_path / "cache"))
    assert restart["tokens"] == plain["tokens"]
    assert restart["loaded"] == restart["compiles"] == plain["compiles"]
    assert restart["saved"] == 0
    assert restart["traces"] == 0  # the model's Python never ran

    # the store emptied, JAX's cache kept (a new context: another source, another store): the
    # steps compiled anew must be XLA's own, not JAX's cache's (which would not run once kept)
    shutil.rmtree(tmp_path / "cache" / "jaxpage-steps")
    refilled = start(model_dir, str(tmp_path / "cache"))
    assert refilled["tokens"] == plain["tokens"]
    assert (refilled["loaded"], refilled["saved"]) == (0, plain["compiles"])
    reloaded = start(model_dir, str(tmp_path / "cache"))
    assert reloaded["tokens"] == plain["tokens"]
    assert (reloaded["loaded"], reloaded["saved"]) == (plain["compiles"], 0)

    # a damaged entry (cut short) is compiled again and rewritten; the rest still load
    entries = sorted((tmp_path / "cache" / "jaxpage-steps").glob("*.jaxexe"))
    assert len(entries) == plain["compiles"]
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    mended = start(model_dir, str(tmp_path / "cache"))
    assert mended["tokens"] == plain["tokens"]
    assert (mended["loaded"], mended["saved"]) == (plain["compiles"] - 1, 1)



def test_a_restart_loads_its_warmups_steps_ahead_and_runs_one_of_them(hf_model_dir, tmp_path):
    """The server's start (`prefetch_warmup` before the model loads, then `warm_up`): a
    restart with the same configuration and code loads every step the last warm-up took on
    threads of its own and runs one warm-up step; the workload takes the rest and serves
    what the first start served. A manifest of another context, or one naming an entry that
    cannot be loaded, is a warm-up as before, which rewrites it."""
    model_dir, _ = hf_model_dir("llama")
    cache = str(tmp_path / "cache")
    first = start(model_dir, cache, "--prefetch")  # no manifest yet: a warm-up
    assert first["ahead"] == 0 and first["saved"] == first["compiles"] > 10
    steps = tmp_path / "cache" / "jaxpage-steps"
    (manifest,) = steps.glob("warmup-*.txt")
    context, *names = manifest.read_text().split("\n")[:-1]
    assert context.startswith("context ") and len(set(names)) == len(names) > 10
    assert all((steps / name).is_file() for name in names)

    restart = start(model_dir, cache, "--prefetch")
    assert restart["tokens"] == first["tokens"]
    assert restart["ahead"] == len(names)
    # every step the workload met was loaded (ahead where the warm-up had taken it)
    assert restart["loaded"] == restart["compiles"] and restart["saved"] == 0
    assert 2 < restart["prefetched"] <= len(names)  # the one warm-up step's and the workload's
    assert restart["traces"] == 0

    for stale in ([context + "0", *names],  # compiled by other code
                  [context, *names[1:], "0" * 64 + ".jaxexe"]):  # an entry gone
        manifest.write_text("\n".join(stale) + "\n")
        rerun = start(model_dir, cache, "--prefetch")
        assert rerun["tokens"] == first["tokens"]
        assert rerun["ahead"] == 0  # a warm-up ran
        assert rerun["loaded"] == first["compiles"] and rerun["saved"] == 0
        assert manifest.read_text().split("\n")[:-1] == [context, *names]  # rewritten

def _scaled_sum(scale, x, w):
    return x @ w * scale, w + 1  # w donated: the store's executables keep the donation


_JITTED = jax.jit(_scaled_sum, static_argnums=0, donate_argnums=2)


def test_store_key_hits_on_new_values_and_misses_on_any_change(tmp_path, caplog):
    device = jax.devices()[0]
    context = "context A"
    x = jnp.arange(6.0).reshape(2, 3)

    def call(store, scale=2.0, shape=(3, 4), key=("f",), seed=0):
        w = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
        expected = np.asarray(x @ w * scale)
        out, new_w = store.get(key, _JITTED, (scale,), (x, w))(x, w)
        np.testing.assert_array_equal(np.asarray(out), expected)
        assert w.is_deleted()  # donated, as by the jitted function
        np.testing.assert_array_equal(np.asarray(new_w), np.asarray(
            np.random.default_rng(seed).standard_normal(shape), np.float32) + 1)

    first = ExecutableStore(tmp_path, context, device)
    call(first)
    assert (first.loaded, first.saved) == (0, 1)
    again = ExecutableStore(tmp_path, context, device)
    call(again, seed=1)  # other values, same shapes: loaded
    assert (again.loaded, again.saved) == (1, 0)
    for change in (dict(scale=3.0), dict(shape=(3, 5)), dict(key=("g",))):
        store = ExecutableStore(tmp_path, context, device)
        call(store, **change)
        assert (store.loaded, store.saved) == (0, 1), change
    other = ExecutableStore(tmp_path, "context B", device)
    call(other)
    assert (other.loaded, other.saved) == (0, 1)

    for entry in tmp_path.glob("*.jaxexe"):
        entry.write_bytes(b"not an executable")
    damaged = ExecutableStore(tmp_path, context, device)
    with caplog.at_level(logging.WARNING, logger="jaxpage.engine.executables"):
        call(damaged)
    assert (damaged.loaded, damaged.saved) == (0, 1)
    assert "unreadable" in caplog.text
    call(ExecutableStore(tmp_path, context, device))  # rewritten whole: loads again


def test_context_digest_covers_the_model_code_and_the_devices():
    from jaxpage.models.llama import LlamaModel

    class Model:
        pass

    devices = jax.devices()[:1]
    base = context_digest(Model(), devices)
    assert context_digest(Model(), devices) == base
    # the model's class comes from another file: its source is part of the context
    assert context_digest(LlamaModel.__new__(LlamaModel), devices) != base
    if len(jax.devices()) > 1:
        assert context_digest(Model(), jax.devices()[1:2]) != base


def test_kept_only_where_enable_compile_cache_says(tmp_path):
    from jaxpage.engine import executables, runner
    from jaxpage.engine_args import enable_compile_cache

    before = (jax.config.jax_compilation_cache_dir, executables.kept_in())
    try:
        executables.keep_in(None)
        assert runner._executable_store(object(), jax.devices()[:1]) is None
        enable_compile_cache(str(tmp_path))
        store = runner._executable_store(object(), jax.devices()[:1])
        assert store.directory == tmp_path / "jaxpage-steps"
        enable_compile_cache("gs://bucket/cache")  # JAX's cache may be remote; this one not
        assert runner._executable_store(object(), jax.devices()[:1]) is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        executables.keep_in(before[1])


_FROM_JAX_CACHE = '''
import json
import sys

import jax
import jax.numpy as jnp

from jaxpage.engine import executables

jax.config.update("jax_compilation_cache_dir", sys.argv[1] + "/jax")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_compilation_cache_include_metadata_in_key", True)  # the store's keys
x = jnp.arange(12.0).reshape(3, 4)
jitted = jax.jit(lambda x: jnp.where(x > 3, x * 2, x).sum(0))
if sys.argv[2] == "fill":  # compiled the way JAX compiles, so written into JAX's cache
    executables._compile_fresh = lambda lowered: (lowered.compile(), True)
store = executables.ExecutableStore(sys.argv[1] + "/" + sys.argv[2], "context", jax.devices()[0])
out = store.get(("f",), jitted, (), (x,))(x)  # lowered the same way and from the same line
print(json.dumps([out.tolist(), store.saved, store.unkept]))
'''


def test_a_step_jax_cache_supplies_is_served_but_not_kept(tmp_path):
    """Should JAX's cache hold a step under the store's own key, the step runs but is not
    written: serialized, an executable JAX loaded from its cache would not run."""
    script = tmp_path / "from_jax_cache.py"
    script.write_text(_FROM_JAX_CACHE)

    def run(mode):
        result = subprocess.run([sys.executable, str(script), str(tmp_path), mode],
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert result.returncode == 0, result.stderr[-4000:]
        return result.stdout

    run("fill")
    assert any((tmp_path / "jax").iterdir())
    out, saved, unkept = json.loads(run("store").strip().splitlines()[-1])
    x = np.arange(12.0).reshape(3, 4)
    assert out == np.where(x > 3, x * 2, x).sum(0).tolist()
    assert (saved, unkept) == (0, 1)
    assert not list((tmp_path / "store").glob("*.jaxexe"))
