"""specprefill-engine: SpecPrefill for MLX, with an asyncio engine around it."""

import logging

from ._blas import preload_blas

logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless configured

preload_blas()

from .core import UnsupportedModelError  # noqa: E402
from .engine import (  # noqa: E402
    Chunk, Engine, EngineFailedError, MemoryBudgetError, RequestFailedError, Result,
)
from .chat.tool_calls import ToolsNotSupportedError  # noqa: E402
from .loading import ModelLoadError, load_model  # noqa: E402

__all__ = ["Chunk", "Engine", "EngineFailedError", "MemoryBudgetError", "ModelLoadError",
           "RequestFailedError", "Result", "ToolsNotSupportedError", "UnsupportedModelError",
           "load_model"]
__version__ = "0.1.0"
