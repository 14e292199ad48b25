"""Everything the worker thread owns: models, tokenizer, scorer, prefix cache."""

from dataclasses import dataclass
from typing import Optional

import mlx.nn as nn

from ..core import DraftScorer, Scorer
from ..loading import check_same_tokenizer, load_model


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings; `keep` and `specprefill` can be overridden per request."""

    keep: float = 0.3
    threshold: int = 1024
    chunk_size: int = 32
    tail_tokens: int = 32
    backbone_pct: float = 0.0
    n_lookahead: int = 8
    pool_kernel: int = 13
    step_size: int = 2048
    prefix_cache_bytes: int = 1 << 30

    def __post_init__(self):
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep!r}")
        if self.threshold < 1 or self.step_size < 1 or self.chunk_size < 1:
            raise ValueError("threshold, step_size and chunk_size must be >= 1")


@dataclass
class Runtime:
    model: nn.Module
    tokenizer: object
    scorer: Optional[Scorer]
    config: EngineConfig
    context_length: Optional[int]


def context_length_of(model: nn.Module) -> Optional[int]:
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_runtime(model_path: str, draft_path: Optional[str], config: EngineConfig,
                 dtype="auto") -> Runtime:
    """Load on the calling thread, which must be the engine's worker.

    Paths are already resolved; without a draft every request prefills densely.
    """
    model, tokenizer = load_model(model_path, dtype=dtype)
    scorer = None
    if draft_path is not None:
        draft, draft_tokenizer = load_model(draft_path, dtype=dtype)
        check_same_tokenizer(tokenizer, draft_tokenizer)
        scorer = DraftScorer(draft, config.n_lookahead, config.pool_kernel, config.step_size)
    return Runtime(model, tokenizer, scorer, config, context_length_of(model))
