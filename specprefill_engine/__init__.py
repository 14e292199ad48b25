"""specprefill-engine: SpecPrefill for MLX, with an asyncio engine around it."""

from ._blas import preload_blas

preload_blas()

from .loading import ModelLoadError, load_model  # noqa: E402

__all__ = ["ModelLoadError", "load_model"]
__version__ = "0.1.0"
