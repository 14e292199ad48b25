"""Prefill the target on the kept tokens only, each at its original position.

Kept tokens are fed in order, so the cache holds N = len(selected) entries and the
causal mask in kept-token space is the right one for full attention; RoPE gets the
true positions from `PositionedRoPE`, and sliding-window layers mask by them
(`windows.py`). Afterwards the model decodes at M + offset through a shift on the
same wrappers, until `cleanup_rope`.
"""

from typing import Generator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from .adapters import (
    check_sparse_prefill_supported, first_attention_cache, rope_owners, sliding_window,
    takes_position_ids,
)
from .positions import install_rope
from .prefill import STEP_SIZE, chunked_prefill
from .scoring import CancelCheck, run_steps


def _validated(tokens, selected) -> tuple[mx.array, np.ndarray]:
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    tokens = tokens.reshape(-1)
    kept = np.asarray(selected, dtype=np.int64).reshape(-1)
    length = tokens.size
    if kept.size == 0:
        raise ValueError("no tokens selected")
    if np.any(np.diff(kept) <= 0) or kept[0] < 0 or kept[-1] >= length:
        raise ValueError("selected must be sorted, unique indices into the prompt")
    if kept[-1] != length - 1:
        raise ValueError("selected must keep the last prompt token")
    return tokens, kept


def decode_shift(model: nn.Module, cache, prompt_length: int, position_offset: int) -> int:
    """How far decode positions must move so the next token lands at M + offset.

    Zero for models without RoPE: their attention has no positions to correct.
    """
    if not rope_owners(model) and not takes_position_ids(model):
        return 0
    return position_offset + prompt_length - first_attention_cache(model, cache).offset


def cover_sliding_window(selected, cache, prompt_length: int, position_offset: int = 0):
    """Add the prompt's last window of tokens when sliding-window layers cannot see
    the whole sequence, so decode attends to the same recent tokens as dense would."""
    kept = np.asarray(selected, dtype=np.int64).reshape(-1)
    window = sliding_window(cache)
    if 0 < window < position_offset + prompt_length:
        kept = np.union1d(kept, np.arange(max(prompt_length - window, 0), prompt_length))
    return kept


def sparse_prefill_steps(
    model: nn.Module,
    tokens,
    selected,
    cache,
    step_size: int = STEP_SIZE,
    position_offset: int = 0,
    cached_positions: Optional[np.ndarray] = None,
) -> Generator[tuple, None, tuple[mx.array, int]]:
    """Prefill one chunk per iteration, yielding (kept tokens done, kept tokens).

    Returns (logits of the last prompt token, shape (1, 1, vocab); decode shift).
    The model is unwrapped between chunks, so other requests may run on it in between.
    `cached_positions`: the position of each entry `cache` already holds (a stored
    sparse prefix); None means 0..n-1, which sliding-window layers need to be true.
    """
    check_sparse_prefill_supported(model)
    tokens, kept = _validated(tokens, selected)
    held = first_attention_cache(model, cache).offset
    if cached_positions is None and held != position_offset \
            and any(isinstance(c, RotatingKVCache) for c in cache):
        raise ValueError(f"cached_positions is needed: the cache holds {held} entries for "
                         f"{position_offset} positions, and sliding-window layers mask by position")
    kept = cover_sliding_window(kept, cache, tokens.size, position_offset)
    logits = yield from chunked_prefill(
        model, tokens[mx.array(kept)], cache, step_size, positions=kept + position_offset,
        cached_positions=cached_positions,
    )
    return logits, decode_shift(model, cache, tokens.size, position_offset)


def sparse_prefill(
    model: nn.Module,
    tokens,
    selected,
    cache,
    step_size: int = STEP_SIZE,
    position_offset: int = 0,
    cancel_check: CancelCheck = None,
    cached_positions: Optional[np.ndarray] = None,
) -> mx.array:
    """Run the kept tokens through `model`; the last token's logits, (1, 1, vocab).

    Leaves the model's RoPE shifted so that plain `model(y, cache=cache)` calls
    decode at M + position_offset onwards; call `cleanup_rope(model)` when done.
    On any exception the model is left unwrapped.
    """
    steps = sparse_prefill_steps(model, tokens, selected, cache, step_size, position_offset,
                                 cached_positions)
    logits, shift = run_steps(steps, cancel_check)
    install_rope(model, shift=shift)
    return logits
