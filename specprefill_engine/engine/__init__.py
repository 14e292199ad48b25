"""The asyncio engine: one MLX worker thread, generate and stream, cancellation."""

from .engine import Engine
from .memory import MemoryBudgetError
from .options import RequestOptions
from .results import Chunk, Result, SpecPrefillReport, Timings, TokenLogprob, Usage
from .runtime import EngineConfig, EngineInfo
from .sampling import SamplingParams
from .scheduler import EngineFailedError, RequestFailedError

__all__ = ["Chunk", "Engine", "EngineConfig", "EngineFailedError", "EngineInfo",
           "MemoryBudgetError", "RequestFailedError", "RequestOptions",
           "Result", "SamplingParams", "SpecPrefillReport", "Timings", "TokenLogprob", "Usage"]
