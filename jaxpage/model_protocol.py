"""The contract a served model meets (see `validate_model`)."""

from __future__ import annotations

from typing import Any


def validate_model(model: Any, params: Any) -> None:
    """Refuse, with an error naming what is wrong, a model that breaks the protocol."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "forward", None)):
        raise ValueError("a served model needs a `config` and a `forward(params, token_ids, "
                         "positions, kv_pool, metadata)` method")
