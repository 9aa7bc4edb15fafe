"""The argument validators shared by the config, sampling and model-contract checks.

Plain Python (no JAX, no NumPy import): NumPy scalars are still accepted, through the
`numbers` ABCs NumPy registers with.
"""

from __future__ import annotations

import numbers
from typing import Any


def check(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise `ValueError("{field} must be {allowed}, got {value!r}")` unless `ok`."""
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def is_int(x: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A real number (int, float, NumPy scalar, ...), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_positive_int(x: Any) -> bool:
    """An integer >= 1, not a bool."""
    return is_int(x) and x >= 1


def is_vector(x: Any) -> bool:
    """A one-dimensional array (numpy's, or any with `ndim` and `tolist`)."""
    return getattr(x, "ndim", None) == 1 and hasattr(x, "tolist")
