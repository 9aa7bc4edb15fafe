"""jaxpage: a paged-attention LLM inference engine on JAX.

The public names are imported lazily so that host-only modules (the block allocator and
scheduler) can be imported without pulling in JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxpage.llm",
    "LLMEngine": "jaxpage.engine.engine",
    "EngineConfig": "jaxpage.config",
    "SamplingParams": "jaxpage.sampling_params",
    "BeamSearchParams": "jaxpage.sampling_params",
    "RequestOutputKind": "jaxpage.sampling_params",
    "RequestOutput": "jaxpage.outputs",
    "CompletionOutput": "jaxpage.outputs",
    "LoRARequest": "jaxpage.lora",
    "StructuredOutputsParams": "jaxpage.structured",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpage' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from jaxpage.config import EngineConfig as EngineConfig
    from jaxpage.engine.engine import LLMEngine as LLMEngine
    from jaxpage.llm import LLM as LLM
    from jaxpage.lora import LoRARequest as LoRARequest
    from jaxpage.outputs import CompletionOutput as CompletionOutput
    from jaxpage.outputs import RequestOutput as RequestOutput
    from jaxpage.sampling_params import BeamSearchParams as BeamSearchParams
    from jaxpage.sampling_params import RequestOutputKind as RequestOutputKind
    from jaxpage.sampling_params import SamplingParams as SamplingParams
    from jaxpage.structured import StructuredOutputsParams as StructuredOutputsParams
