"""Pick which prompt tokens the target prefills: whole chunks, by mean importance.

Always kept, inside the budget of about keep_pct * M tokens: the first chunk
(attention sinks, the chat template's start) and the prompt's last `tail_tokens`
tokens (the question and the template's end, so the first generated token comes
from the real last prompt token). `backbone_pct` adds evenly spaced chunks. What
the budget has left goes to whole chunks with the highest mean importance. All of
it runs as array ops; the only host transfer is the final index list.
"""

import math

import mlx.core as mx
import numpy as np


def select_chunks(
    importance: mx.array,
    keep_pct: float = 0.3,
    chunk_size: int = 32,
    backbone_pct: float = 0.0,
    tail_tokens: int = 32,
) -> mx.array:
    """Sorted int32 indices of the kept tokens."""
    if not 0.0 < keep_pct <= 1.0:
        raise ValueError(f"keep_pct must be in (0, 1], got {keep_pct}")
    if not 0.0 <= backbone_pct <= 1.0:
        raise ValueError(f"backbone_pct must be in [0, 1], got {backbone_pct}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    importance = importance.reshape(-1).astype(mx.float32)
    length = importance.size
    if length == 0:
        raise ValueError("importance is empty")
    n_chunks = math.ceil(length / chunk_size)
    padded = mx.pad(importance, [(0, n_chunks * chunk_size - length)])
    counts = mx.minimum(length - mx.arange(n_chunks) * chunk_size, chunk_size)
    chunk_mean = padded.reshape(n_chunks, chunk_size).sum(axis=1) / counts

    positions = mx.arange(length)
    forced_tokens = (positions < chunk_size) | (positions >= length - max(tail_tokens, 1))
    n_backbone = round(backbone_pct * n_chunks)
    if n_backbone > 0:
        backbone = np.zeros(n_chunks, dtype=bool)
        backbone[np.linspace(0, n_chunks - 1, n_backbone).round().astype(np.int64)] = True
        forced_tokens = forced_tokens | mx.repeat(mx.array(backbone), chunk_size)[:length]
    n_forced = forced_tokens.sum()

    # chunks wholly forced already are kept; rank the others by mean importance and
    # fill what the budget has left with whole chunks (rounding up, as a chunk budget
    # of ceil(keep_pct * n_chunks) would)
    budget = math.ceil(keep_pct * length)
    whole = mx.pad(forced_tokens, [(0, n_chunks * chunk_size - length)], constant_values=True)
    fully_forced = whole.reshape(n_chunks, chunk_size).all(axis=1)
    n_free = mx.maximum((budget - n_forced + chunk_size - 1) // chunk_size, 0)
    ranked = mx.where(fully_forced, -mx.inf, chunk_mean)
    rank = mx.argsort(mx.argsort(-ranked))
    chosen = (rank < n_free) & ~fully_forced
    token_mask = forced_tokens | mx.repeat(chosen, chunk_size)[:length]
    if keep_pct == 1.0:
        token_mask = mx.ones(length, dtype=mx.bool_)
    return mx.array(np.flatnonzero(np.array(token_mask)).astype(np.int32))
