"""The CPU kernel library builds and registers on x86-64 Linux, the platform CI runs on. The
kernel tests skip where `cpu_ops.available()` is false, and `cpu_library.loaded()` turns a
failed build or registration into a warning and False (the models then take the jnp path), so
a compile error in the C++ would skip them all and pass: this test does not skip there."""

from __future__ import annotations

import os
import platform
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
