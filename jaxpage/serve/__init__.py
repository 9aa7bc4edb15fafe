"""jaxpage's OpenAI-compatible server (`python -m jaxpage.serve`; `pip install jaxpage[server]`).

`build_app(engine, model_name=...)` is the FastAPI app over an LLMEngine; `AsyncEngine` runs
the engine on its own thread for any asyncio code.
"""

from jaxpage.serve.app import build_app
from jaxpage.serve.async_engine import AsyncEngine, EngineDeadError, EngineRequest, OverloadedError

__all__ = ["AsyncEngine", "EngineDeadError", "EngineRequest", "OverloadedError", "build_app"]
