"""The synchronous SpecPrefill algorithm: score, select, sparse prefill."""

from .adapters import UnsupportedModelError, attention_sites
from .positions import cleanup_rope, positioned_rope
from .prefill import chunked_prefill
from .scoring import DraftScorer, Scorer, run_steps, score_steps, score_tokens
from .selection import select_chunks
from .sparse_prefill import sparse_prefill, sparse_prefill_steps

__all__ = [
    "DraftScorer",
    "Scorer",
    "UnsupportedModelError",
    "attention_sites",
    "chunked_prefill",
    "cleanup_rope",
    "positioned_rope",
    "run_steps",
    "score_steps",
    "score_tokens",
    "select_chunks",
    "sparse_prefill",
    "sparse_prefill_steps",
]
