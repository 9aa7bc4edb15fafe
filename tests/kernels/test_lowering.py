"""`pallas_kernels.lowering.choose`: where the caller names its platform, only that form is
traced (the runner's steps, traced for their device); where it does not, both are, and the one
for the platform the program is lowered for runs (`jax.export` for a TPU on this CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import lowering


def _cpu(x):
    return jnp.sin(x)


def _default(x):
    return jnp.cos(x)


def _fn():
    """A new function each time: JAX caches a function's trace by the function and its
    arguments' types, never by the platform named around it (which is why the runner makes
    the platform a static argument of its jitted step)."""
    return lambda x: lowering.choose(x, cpu=_cpu, default=_default)


def _primitives(platform):
    with lowering.for_platform(platform):
        jaxpr = jax.make_jaxpr(_fn())(jnp.ones(3))
    return {eqn.primitive.name for eqn in jaxpr.eqns}


def test_a_named_platform_traces_its_form_alone():
    assert _primitives("cpu") == {"sin"}
    assert _primitives("tpu") == {"cos"}
    assert _primitives("gpu") == {"cos"}
    both = _primitives(None)  # platform_dependent: a switch over both forms
    assert "cond" in both and "sin" not in both  # the forms sit inside the switch's branches


def test_the_platform_is_decided_at_lowering_when_unnamed():
    x = jnp.arange(3.0)
    np.testing.assert_allclose(np.asarray(jax.jit(_fn())(x)), np.sin(np.arange(3.0)),
                               rtol=1e-6)
    tpu = jax.export.export(jax.jit(_fn()), platforms=["tpu"])(x).mlir_module()
    assert "stablehlo.cosine" in tpu and "stablehlo.sine" not in tpu
    with lowering.for_platform("cpu"):  # named: even an export for TPU holds the CPU form
        forced = jax.export.export(jax.jit(_fn()), platforms=["tpu"])(x).mlir_module()
    assert "stablehlo.sine" in forced and "stablehlo.cosine" not in forced


def test_the_name_holds_only_inside_the_block():
    with lowering.for_platform("tpu"):
        assert _primitives("cpu") == {"sin"}  # the inner block wins
        assert _fn()(jnp.zeros(1)).tolist() == [1.0]  # cos(0): the TPU form, run eagerly
    assert "cond" in _primitives(None)
