"""LangChain chat model backed by a specprefill-engine Engine."""

from specprefill_engine import (
    EngineFailedError, ModelLoadError, RequestFailedError, ToolsNotSupportedError,
    UnsupportedModelError,
)

from .chat_model import ChatSpecPrefill
from .messages import UnsupportedContentError

__all__ = ["ChatSpecPrefill", "EngineFailedError", "ModelLoadError", "RequestFailedError",
           "ToolsNotSupportedError", "UnsupportedContentError", "UnsupportedModelError"]
