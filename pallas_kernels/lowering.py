"""The platform a function is traced for, where its caller knows it.

`jax.lax.platform_dependent` traces every branch and picks one when the program is lowered, so
a function traced once may lower for any platform (`jax.export` for a TPU on this CPU). That
has a price: tracing the runner's forward step for XLA:CPU traced both forms of ~180 ops (the
kernel library's call and the jnp ops), 0.95 of its 1.15 s (SmolLM2, a 48-row decode step),
and a server's warm-up traces every step shape. A caller that knows its target (the runner
knows its devices) says so with `for_platform`, and `choose` then traces that form alone;
without it, `choose` is `platform_dependent`.

JAX caches a function's trace by the function and its arguments' types, not by the platform
named around it: a jitted function traced inside `for_platform` must take the platform as a
static argument (as the runner's forward step does); one traced outside it (the runner's block
copies) lowers per platform as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxpage_lowering_target",
                                                                     default=None)


@contextlib.contextmanager
def for_platform(platform: str | None) -> Iterator[None]:
    """Trace for `platform` ("cpu", "gpu", "tpu"; None: any) inside the block."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def choose(*args: Any, cpu: Callable, default: Callable) -> Any:
    """`cpu(*args)` where the program is for XLA:CPU, else `default(*args)`; decided now where
    the platform is known (`for_platform`), else at lowering (`jax.lax.platform_dependent`)."""
    target = _TARGET.get()
    if target is None:
        return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
    return (cpu if target == "cpu" else default)(*args)
