"""A prompt's greedy answer, from a dense or a sparse prefill: what the draft check and
the quality benchmarks compare."""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .positions import cleanup_rope
from .prefill import STEP_SIZE, chunked_prefill
from .scoring import run_steps
from .sparse_prefill import sparse_prefill


def greedy(model, logits, cache, n: int, eos: set) -> list:
    """Up to `n` greedy tokens from `logits`, the cache holding the prompt."""
    tokens = [mx.argmax(logits, axis=-1).item()]
    while len(tokens) < n and tokens[-1] not in eos:
        tokens.append(mx.argmax(model(mx.array([[tokens[-1]]]), cache=cache)[:, -1], axis=-1).item())
    return tokens


def dense_answer(model, ids, n: int, eos: set, step_size: int = STEP_SIZE) -> list:
    """Up to `n` greedy tokens after a dense prefill of `ids` (ending at an `eos` id)."""
    cache = make_prompt_cache(model)
    logits = run_steps(chunked_prefill(model, mx.array(ids), cache, step_size))
    return greedy(model, logits[:, -1], cache, n, eos)


def sparse_answer(model, ids, kept, n: int, eos: set, step_size: int = STEP_SIZE) -> list:
    """Up to `n` greedy tokens after prefilling only the `kept` positions of `ids`."""
    cache = make_prompt_cache(model)
    try:
        logits = sparse_prefill(model, ids, kept, cache, step_size=step_size)
        return greedy(model, logits, cache, n, eos)
    finally:
        cleanup_rope(model)
