"""Score prompt tokens by how much a draft model's lookahead attends to them.

The draft prefills the prompt, then decodes a few lookahead tokens. On each
lookahead step we capture every attention layer's post-RoPE query (the first
`rope` call of a forward is the query in mlx-lm's attention layers) and score it
against the cached prompt keys: softmax(q k^T * scale), average-pooled along the
prompt, max over layers x heads, mean over lookahead steps. Scores are reduced one
layer at a time, so the extra memory is one layer's (heads, steps, M) block.
"""

from dataclasses import dataclass
from typing import Callable, Generator, Optional, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .adapters import AttentionSite, UnsupportedModelError, attention_sites, sees_whole_prompt
from .prefill import chunked_prefill

CancelCheck = Optional[Callable[[], None]]


class Scorer(Protocol):
    """Anything that returns one importance score per prompt token.

    `score_steps` does the work one unit per iteration and returns the scores, so
    the engine can interleave it with other requests; `score` runs it to the end.
    """

    def score_steps(self, tokens: mx.array) -> Generator[tuple, None, mx.array]: ...

    def score(self, tokens: mx.array, cancel_check: CancelCheck = None) -> mx.array: ...


class QueryCapture(nn.Module):
    """Wraps a layer's `rope` (or `q_proj`) and keeps its first output of a forward:
    the query (the second rope call of a forward rotates the keys)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.query = None

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        out = self.inner(x, *args, **kwargs)
        if self.query is None:
            self.query = out
        return out


def _as_heads(query: mx.array, site: AttentionSite, head_dim: int) -> mx.array:
    """Captured queries as (1, heads, steps, head_dim); q_proj output is (1, steps, H*D)."""
    if site.query_source == "rope":
        return query
    batch, steps, width = query.shape
    return query.reshape(batch, steps, width // head_dim, head_dim).transpose(0, 2, 1, 3)


def average_pool(x: mx.array, kernel: int) -> mx.array:
    """Stride-1 average pool over the last axis, zero padded to keep the length."""
    if kernel <= 1:
        return x
    left = kernel // 2
    right = kernel - 1 - left
    pad = [(0, 0)] * (x.ndim - 1) + [(left + 1, right)]
    total = mx.cumsum(mx.pad(x, pad), axis=-1)
    return (total[..., kernel:] - total[..., :-kernel]) / kernel


def layer_importance(query: mx.array, keys: mx.array, scale: float, pool_kernel: int):
    """(steps, M) importance for one layer: max over heads of pooled attention.

    query: (1, Hq, steps, D) post-RoPE; keys: (1, Hkv, M, D) post-RoPE.
    """
    _, n_heads, steps, dim = query.shape
    n_kv = keys.shape[1]
    q = query.astype(mx.float32).reshape(n_kv, n_heads // n_kv, steps, dim)
    k = keys[0].astype(mx.float32)[:, None]
    attention = mx.softmax((q * scale) @ k.swapaxes(-1, -2), axis=-1)
    pooled = average_pool(attention, pool_kernel)
    return pooled.max(axis=(0, 1))


def _scored_sites(model, prompt_length: int, cache) -> list[AttentionSite]:
    sites = [
        site
        for site in attention_sites(model)
        if sees_whole_prompt(cache[site.cache_index], prompt_length)
    ]
    if not sites:
        raise UnsupportedModelError(
            "the draft has no attention layer whose cache sees the whole prompt"
        )
    return sites


def _forward_capturing_queries(model, token: mx.array, cache, sites) -> tuple:
    """One decode step; returns (logits, post-RoPE query per site).

    The capture wrappers live only for this call, so other users of the same
    draft between steps see the plain model.
    """
    captures = [QueryCapture(site.attention[site.query_source]) for site in sites]
    for site, capture in zip(sites, captures):
        setattr(site.attention, site.query_source, capture)
    try:
        logits = model(token[None], cache=cache)[0, -1]
    finally:
        for site, capture in zip(sites, captures):
            setattr(site.attention, site.query_source, capture.inner)
    return logits, [capture.query for capture in captures]


def score_steps(
    draft_model: nn.Module,
    tokens,
    n_lookahead: int = 8,
    pool_kernel: int = 13,
    step_size: int = 2048,
    temperature: float = 0.0,
) -> Generator[tuple, None, mx.array]:
    """`score_tokens` one unit of work per iteration (a chunk, a step, a layer).

    Yields (units done, total units); returns the importance array.
    """
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    tokens = tokens.reshape(-1)
    prompt_length = tokens.size
    if prompt_length < 1:
        raise ValueError("cannot score an empty prompt")
    if n_lookahead < 1:
        raise ValueError("n_lookahead must be at least 1")
    cache = make_prompt_cache(draft_model)
    sites = _scored_sites(draft_model, prompt_length, cache)
    done = 0
    total = -(-(prompt_length - 1) // step_size) + n_lookahead + len(sites)
    for _ in chunked_prefill(draft_model, tokens[:-1], cache, step_size, want_logits=False):
        done += 1
        yield done, total

    queries = [[] for _ in sites]
    token = tokens[-1:]
    for _ in range(n_lookahead):
        logits, step_queries = _forward_capturing_queries(draft_model, token, cache, sites)
        if temperature > 0:
            token = mx.random.categorical(logits / temperature)[None]
        else:
            token = mx.argmax(logits)[None]
        for layer_queries, query in zip(queries, step_queries):
            layer_queries.append(query)
        mx.eval(token, step_queries)
        done += 1
        yield done, total

    importance = None
    for site, layer_queries in zip(sites, queries):
        keys = cache[site.cache_index].keys[..., :prompt_length, :]
        step_axis = 2 if site.query_source == "rope" else 1
        query = _as_heads(mx.concatenate(layer_queries, axis=step_axis), site, keys.shape[-1])
        if query.shape[-1] != keys.shape[-1] or query.shape[1] % keys.shape[1]:
            raise UnsupportedModelError(
                f"{type(draft_model).__module__}: rotated queries {tuple(query.shape)} do not "
                f"match cached keys {tuple(keys.shape)} (latent attention such as MLA caches "
                "a compressed key); use a draft with standard attention"
            )
        scale = getattr(site.attention, "scale", query.shape[-1] ** -0.5)
        layer = layer_importance(query, keys, scale, pool_kernel)
        importance = layer if importance is None else mx.maximum(importance, layer)
        mx.eval(importance)
        done += 1
        yield done, total
    return importance.mean(axis=0)


def run_steps(steps: Generator, cancel_check: CancelCheck = None):
    """Drive a step generator to its return value, checking for cancellation."""
    while True:
        if cancel_check:
            cancel_check()
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def score_tokens(
    draft_model: nn.Module,
    tokens,
    n_lookahead: int = 8,
    pool_kernel: int = 13,
    step_size: int = 2048,
    temperature: float = 0.0,
    cancel_check: CancelCheck = None,
) -> mx.array:
    """Importance of every prompt token, shape (M,), float32.

    Lookahead is greedy unless `temperature` > 0. The draft's cache is dropped
    on return (MLX's buffer cache keeps the memory for the next request). `cancel_check()` runs between prefill chunks, lookahead
    steps and layers, and may raise to abort.
    """
    steps = score_steps(draft_model, tokens, n_lookahead, pool_kernel, step_size, temperature)
    return run_steps(steps, cancel_check)


@dataclass
class DraftScorer:
    """A draft model that shares the target's tokenizer, as a Scorer."""

    model: nn.Module
    n_lookahead: int = 8
    pool_kernel: int = 13
    step_size: int = 2048
    temperature: float = 0.0

    def score_steps(self, tokens: mx.array) -> Generator[tuple, None, mx.array]:
        return score_steps(
            self.model, tokens, self.n_lookahead, self.pool_kernel, self.step_size,
            self.temperature,
        )

    def score(self, tokens: mx.array, cancel_check: CancelCheck = None) -> mx.array:
        return run_steps(self.score_steps(tokens), cancel_check)
