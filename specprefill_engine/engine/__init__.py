"""The asyncio engine: one MLX worker thread, generate and stream, cancellation."""

from .engine import Engine
from .results import Chunk, Result, SpecPrefillReport, Timings, Usage
from .runtime import EngineConfig
from .sampling import SamplingParams

__all__ = ["Chunk", "Engine", "EngineConfig", "Result", "SamplingParams", "SpecPrefillReport",
           "Timings", "Usage"]
