"""LangChain chat model backed by a specprefill-engine Engine."""

from .chat_model import ChatSpecPrefill

__all__ = ["ChatSpecPrefill"]
