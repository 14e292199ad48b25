"""The one chunked-prefill routine: dense or sparse, target or draft.

Tokens go through the model `step_size` at a time, each chunk in its own forward
call so a scheduler can interleave other work between chunks. With `positions`
(sparse prefill: the kept tokens' original positions) every call gets its own
position handling, removed right after it (see `positions.py`); without, the call
still resets whatever state another request's call may have left on a shared model
(mlx-vlm's rope-delta carrier).
"""

from typing import Generator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapters import takes_position_ids
from .positions import position_runs, positioned_rope


def logits_of(output) -> mx.array:
    """mlx-lm models return logits; mlx-vlm language models an object holding them."""
    return output if isinstance(output, mx.array) else output.logits


def _forward(model: nn.Module, inputs: mx.array, cache, positions: Optional[np.ndarray]):
    if positions is None:
        with positioned_rope(model):
            return model(inputs, cache=cache)
    if takes_position_ids(model):  # text tokens: one position row, as the model lays out its own
        with positioned_rope(model):
            return model(inputs, cache=cache, position_ids=mx.array(positions, mx.int32)[None])
    with positioned_rope(model, runs=position_runs(positions)):
        return model(inputs, cache=cache)


def chunked_prefill(
    model: nn.Module,
    tokens: mx.array,
    cache: list,
    step_size: int,
    positions: Optional[np.ndarray] = None,
    want_logits: bool = True,
) -> Generator[tuple, None, Optional[mx.array]]:
    """Feed `tokens` in chunks, yielding (tokens done, tokens) after each.

    Returns the last token's logits, shape (1, 1, vocab), or None when
    `want_logits` is False (only the cache is wanted, e.g. a draft before its
    lookahead). `positions`, when given, holds each token's absolute position.
    """
    if step_size < 1:
        raise ValueError(f"step_size must be >= 1, got {step_size}")
    tokens = tokens.reshape(-1)
    total = tokens.size
    logits = None
    for start in range(0, total, step_size):
        end = min(start + step_size, total)
        chunk_positions = None if positions is None else positions[start:end]
        output = _forward(model, tokens[start:end][None], cache, chunk_positions)
        if want_logits and end == total:
            logits = logits_of(output)[:, -1:, :]
            mx.eval(logits, [c.state for c in cache])
        else:
            mx.eval([c.state for c in cache])
        yield end, total
    return logits
