"""The CPU kernel library builds and registers on x86-64 Linux, the platform CI runs on. The
kernel tests skip where `cpu_ops.available()` is false, and `cpu_library.loaded()` turns a
failed build or registration into a warning and False (the models then take the jnp path), so
a compile error in the C++ would skip them all and pass: this test does not skip there."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library, cpu_ops


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="CI builds the library on x86-64 Linux; elsewhere it may not build")
def test_the_library_builds_and_loads_on_x86_64_linux():
    """The build (or its cached copy) is a file, its FFI targets register, and an op runs
    through them: a greedy draw is NumPy's argmax, with float64's log-probability."""
    path = cpu_library._library_path()  # a compile error raises here, with the compiler's output
    assert path.is_file()
    assert cpu_library.available(), (
        "the library built but did not load or register (see the warning above); "
        f"JAXPAGE_NO_CPU_KERNEL={os.environ.get('JAXPAGE_NO_CPU_KERNEL')!r}")
    logits = np.random.default_rng(0).normal(size=(3, 97)).astype(np.float32)
    tokens, logprobs = cpu_ops.greedy_draw(jnp.asarray(logits))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    x = logits.astype(np.float64)
    want = -np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(logprobs, want, rtol=0, atol=1e-6)


_STARTED_BUILD = """
import json, threading, warnings
from pallas_kernels import cpu_library

real_build, ran_on = cpu_library._build, []


def build(*args, **kwargs):
    ran_on.append(threading.current_thread().name)
    if FAIL:
        raise RuntimeError("no compiler here")
    return real_build(*args, **kwargs)


cpu_library._build = build
cpu_library.start_build()
cpu_library.start_build()  # a second call starts nothing more
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ok = cpu_library.available()
cpu_library.start_build()  # loaded: nothing to start
print(json.dumps([ran_on, ok, [str(w.message) for w in caught]]))
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="CI builds the library on x86-64 Linux; elsewhere it may not build")
@pytest.mark.parametrize("fail", [False, True], ids=["builds", "fails"])
def test_a_build_started_early_is_the_one_loaded(fail):
    # LLM() starts the build on a thread of its own before it loads the model; `loaded()` then
    # takes that build's library (the build runs once, on that thread) or, where it failed,
    # warns and falls back as a build of its own would. A fresh process: this one's library is
    # loaded already. The build itself is the real one (cached after the first).
    cpu_library._library_path()  # built (and cached) before the child needs it
    result = subprocess.run([sys.executable, "-c", f"FAIL = {fail}\n" + _STARTED_BUILD],
                            capture_output=True, text=True, timeout=600,
                            env={k: v for k, v in os.environ.items()
                                 if k not in ("JAXPAGE_NO_CPU_KERNEL", "JAXPAGE_CPU_KERNEL_LIB")})
    assert result.returncode == 0, result.stderr[-3000:]
    ran_on, ok, warned = json.loads(result.stdout.strip().splitlines()[-1])
    assert ran_on == ["jaxpage-kernel-build"]
    assert ok is (not fail)
    assert bool(warned) == fail and all("no compiler here" in w or "unavailable" in w
                                        for w in warned)
