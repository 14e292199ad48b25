"""OpenAI- and Anthropic-compatible HTTP server over a specprefill-engine Engine."""

from .app import ServerConfig, create_app
from .serve import server

__all__ = ["ServerConfig", "create_app", "server"]
