"""Score prompt tokens by how much a draft model's lookahead attends to them.

The draft prefills the prompt; the forward of its last chunk also captures every
attention layer's post-RoPE queries of the last `n_window` prompt tokens (the first
`rope` call of a forward is the query in mlx-lm's attention layers). The last prompt
token's query is lookahead step 1, free; `n_lookahead - 1` greedy decode steps add
one query each (each costs a draft decode step, latency bound on a GPU). Each query
is scored against the cached prompt keys: softmax(q k^T * scale) (causal for the
window rows), average-pooled along the prompt, max over layers x heads, mean over
queries. All layers are reduced in one unit of work, evaluated once.

The window is the question: a small draft's last token often attends nowhere in
particular, while the question's own words (a function's name, a key) attend to where
they occur earlier (what follows that place, the selection keeps: `selection.py`).
Where the question is not at the prompt's end (a coding agent's: the user's message,
then the call and the file it read), its words are forwarded once more after the
prompt (`echo_question`): causal attention lets the words at their own place see only
what came before them, the copy after the prompt sees all of it. Their queries count
as lookahead rows; their cache entries follow the prompt's, as the lookahead's do.
"""

from dataclasses import dataclass
from typing import Callable, Generator, Optional, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from .adapters import AttentionSite, UnsupportedModelError, attention_sites, sees_whole_prompt
from .positions import positioned_rope
from .prefill import STEP_SIZE, chunk_plan, chunked_prefill, logits_of

# the scoring's defaults, here once (the engine's `EngineConfig` takes them too)
N_LOOKAHEAD = 1  # queries: the prompt's last token's, then this many - 1 lookahead steps
N_WINDOW = 32  # queries: the prompt's last tokens' (its question), besides the lookahead's
POOL_KERNEL = 13  # width of the average pool that smooths importance over neighbours

CancelCheck = Optional[Callable[[], None]]


class Scorer(Protocol):
    """Anything that returns one importance score per prompt token.

    `score_steps` does the work one unit per iteration and returns the scores, so
    the engine can interleave it with other requests; `score` runs it to the end.
    """

    def score_steps(self, tokens: mx.array,
                    cache: Optional[list] = None) -> Generator[tuple, None, mx.array]: ...

    def score(self, tokens: mx.array, cancel_check: CancelCheck = None) -> mx.array: ...


class QueryCapture(nn.Module):
    """Wraps a layer's `rope` (or `q_proj`) and keeps the query of a forward: its first
    output (the second rope call of a forward rotates the keys), cut to the last
    `keep_last` tokens (`axis`: the token axis of that output)."""

    def __init__(self, inner: nn.Module, keep_last: int = 1, axis: int = -2):
        super().__init__()
        self.inner = inner
        self.keep_last = keep_last
        self.axis = axis
        self.query = None

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        out = self.inner(x, *args, **kwargs)
        if self.query is None:
            length = out.shape[self.axis]
            start = max(length - self.keep_last, 0)
            index = [slice(None)] * out.ndim
            index[self.axis] = slice(start, length)
            self.query = out[tuple(index)]
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


def scored_sites(model, prompt_length: int, cache) -> list[AttentionSite]:
    """The draft's attention layers whose caches see the whole prompt."""
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


def _forward_capturing_queries(model, tokens: mx.array, cache, sites, keep_last: int = 1):
    """One forward of `tokens` (1-D); returns (last logits, per site the post-RoPE
    queries of the last `keep_last` tokens).

    The capture wrappers live only for this call, so other users of the same
    draft between steps see the plain model.
    """
    captures = [QueryCapture(site.attention[site.query_source], keep_last,
                             -2 if site.query_source == "rope" else 1) for site in sites]
    for site, capture in zip(sites, captures):
        setattr(site.attention, site.query_source, capture)
    try:
        with positioned_rope(model):  # clears a shared VLM's position state, as prefill does
            output = model(tokens[None], cache=cache)
        logits = logits_of(output)[0, -1]
    finally:
        for site, capture in zip(sites, captures):
            setattr(site.attention, site.query_source, capture.inner)
    return logits, [capture.query for capture in captures]


def _masked_layer_importance(query, keys, scale, pool_kernel, n_window, prompt_length,
                             first: int = 0):
    """`layer_importance` where query rows `first`, `first + 1`, ... before `n_window` are
    the prompt's own last tokens: each sees only the keys up to its position (causal),
    as in the prefill, and each but the last prompt token's counts only keys at least
    `n_window` before it: a row's attention to its own neighbourhood says nothing about
    the question, and would spend the budget on the text just before it. Later rows
    (lookahead, the question's copy) see every prompt key."""
    if n_window <= 1:  # the last prompt token sees every prompt key
        return layer_importance(query, keys, scale, pool_kernel)
    _, n_heads, steps, dim = query.shape
    n_kv = keys.shape[1]
    q = query.astype(mx.float32).reshape(n_kv, n_heads // n_kv, steps, dim)
    k = keys[0].astype(mx.float32)[:, None]
    scores = (q * scale) @ k.swapaxes(-1, -2)
    rows = mx.arange(first, first + steps)
    row_position = mx.where(rows < n_window, prompt_length - n_window + rows, prompt_length)
    keys_at = mx.arange(prompt_length)[None, :]
    attention = mx.softmax(mx.where(keys_at > row_position[:, None], -mx.inf, scores), axis=-1)
    near = (keys_at > row_position[:, None] - n_window) & \
        (row_position < prompt_length - 1)[:, None]
    attention = mx.where(near, 0.0, attention)
    return average_pool(attention, pool_kernel).max(axis=(0, 1))


def default_draft_step_size() -> int:
    """Draft prefill chunk for scoring on this device: large on a GPU, where smaller
    chunks leave a 0.6B-class draft bound by per-call overhead (docs/benchmarks.md); on
    a CPU small, so other requests interleave."""
    return 128 if mx.default_device() == mx.cpu else 8192


def capture_start(prompt_length: int, step_size: int, n_window: int = 1) -> int:
    """Where the scoring's last chunk, the forward that captures the queries, starts (it
    holds at least the window): a draft cache restored past it is cut back (a cache
    that cannot be cut must be restored at or before it)."""
    start = max(((prompt_length - 1) // step_size) * step_size, 0)
    return min(start, prompt_length - min(n_window, prompt_length))


def score_plan(prompt_length: int, cached: int, step_size: int, n_window: int,
               trimmable: bool) -> tuple[int, int]:
    """Where scoring starts and where its capturing chunk starts: (cached, capture_from).
    A draft cache restored past the grid's last chunk is cut back to it when it can be
    (the same chunks as from scratch, so the importance is a fresh draft's); one that
    cannot be cut is continued from where it is."""
    n_window = min(n_window, prompt_length)
    last_start = capture_start(prompt_length, step_size, n_window)
    if cached > last_start and trimmable:
        cached = last_start
    return cached, max(last_start, min(cached, prompt_length - n_window))


def capture_window(draft_model: nn.Module, tokens: mx.array, cache, sites, n_window: int,
                   n_lookahead: int, temperature: float = 0.0):
    """The prompt's last chunk through the draft, capturing the window's queries (the last
    prompt token's is lookahead step 1): (per site its queries, the next lookahead token
    or None), evaluated."""
    logits, window = _forward_capturing_queries(draft_model, tokens, cache, sites,
                                                keep_last=n_window)
    if n_lookahead > 1:
        token = _next_token(logits, temperature)
        mx.eval(token, window)
    else:  # no decode step follows: the chunk's logits (its lm_head) are never computed
        token = None
        mx.eval(window)
    return [[query] for query in window], token


def lookahead_step(draft_model: nn.Module, token: mx.array, cache, sites, queries: list,
                   temperature: float = 0.0) -> mx.array:
    """One draft decode step from `token`; its queries join `queries`; the next token,
    queued."""
    logits, step_queries = _forward_capturing_queries(draft_model, token, cache, sites)
    token = _next_token(logits, temperature)
    for layer_queries, query in zip(queries, step_queries):
        layer_queries.append(query)
    mx.async_eval(token, step_queries)
    return token


def echo_question(draft_model: nn.Module, question: mx.array, cache, sites,
                  queries: list) -> None:
    """`question` (1-D: the question's own tokens) through the draft after what its
    cache holds; every token's queries join `queries`, evaluated."""
    _, echoed = _forward_capturing_queries(draft_model, question, cache, sites,
                                           keep_last=question.size)
    for layer_queries, query in zip(queries, echoed):
        layer_queries.append(query)
    mx.eval(echoed)


def importance_of(draft_model: nn.Module, sites, queries: list, cache, prompt_length: int,
                  pool_kernel: int, n_window: int) -> mx.array:
    """Every layer's queries against its cached prompt keys, reduced to one importance
    per prompt token (max over layers x heads, mean over queries), evaluated."""
    n_window = min(n_window, prompt_length)
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
        block, rows = max(n_window, 1), []  # rows at a time: the scores' memory is a window's
        for first in range(0, query.shape[2], block):
            rows.append(_masked_layer_importance(query[:, :, first:first + block], keys, scale,
                                                 pool_kernel, n_window, prompt_length, first))
            mx.eval(rows[-1])
        layer = mx.concatenate(rows)
        importance = layer if importance is None else mx.maximum(importance, layer)
        mx.eval(importance)  # a layer's scores at a time: one graph would hold every layer's
    importance = importance.mean(axis=0)
    mx.eval(importance)
    return importance


def check_score_arguments(prompt_length: int, n_lookahead: int, n_window: int,
                          step_size: int) -> None:
    if prompt_length < 1:
        raise ValueError("cannot score an empty prompt")
    if n_lookahead < 1:
        raise ValueError("n_lookahead must be at least 1")
    if n_window < 1:
        raise ValueError("n_window must be at least 1")
    if step_size < 1:
        raise ValueError(f"step_size must be >= 1, got {step_size}")


def score_steps(
    draft_model: nn.Module,
    tokens,
    n_lookahead: int = N_LOOKAHEAD,
    pool_kernel: int = POOL_KERNEL,
    step_size: int = STEP_SIZE,
    temperature: float = 0.0,
    n_window: int = N_WINDOW,
    cache: Optional[list] = None,
    question=None,
) -> Generator[tuple, None, mx.array]:
    """`score_tokens` one unit of work per iteration (a prefill chunk, a lookahead
    step, the reduction over layers). Yields (units done, total units); returns the
    importance array.

    `cache`, when given, is the draft's cache to use: it may already hold the KV of a
    prefix of `tokens` (a draft prefix-cache hit; it is cut back to the last full
    prefill chunk if it holds more, so the importance is what a fresh draft gives; a
    cache that cannot be cut, a hybrid draft's, is continued from where it is, which
    rounds differently), and afterwards holds the whole prompt's KV in its first
    len(tokens) entries (the lookahead's and the question's follow), for the caller
    to keep.

    The draft prefills the whole prompt; its last chunk's forward also captures the
    queries of the prompt's last `n_window` tokens (free: no extra forward). The last
    prompt token's query is lookahead step 1; `n_lookahead - 1` greedy decode steps
    add one query each. So `n_lookahead=1` costs nothing beyond the draft's prefill.
    `question`: token ids of a question before the prompt's end, forwarded after it
    (`echo_question`; one more forward of its length).
    """
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    tokens = tokens.reshape(-1)
    prompt_length = tokens.size
    check_score_arguments(prompt_length, n_lookahead, n_window, step_size)
    cache = make_prompt_cache(draft_model) if cache is None else cache
    sites = scored_sites(draft_model, prompt_length, cache)
    held = cache[sites[0].cache_index].offset
    cached, capture_from = score_plan(prompt_length, held, step_size, n_window,
                                      can_trim_prompt_cache(cache))
    if cached < held:
        for layer in cache:  # back to the grid: the same chunks as from scratch
            layer.trim(layer.offset - cached)
    plan = chunk_plan(capture_from - cached, cached, step_size, 0.0)  # chunked_prefill's yields
    n_chunks = sum(pause for _, pause in plan) + 1
    question = None if question is None or not len(question) else mx.array(question).reshape(-1)
    done, total = 0, n_chunks + (n_lookahead - 1) + (question is not None) + 1
    for _ in chunked_prefill(draft_model, tokens[cached:capture_from], cache, step_size,
                             want_logits=False, balanced=False):
        done += 1
        yield done, total
    queries, token = capture_window(draft_model, tokens[capture_from:], cache, sites,
                                    min(n_window, prompt_length), n_lookahead, temperature)
    done += 1
    yield done, total
    for _ in range(n_lookahead - 1):
        token = lookahead_step(draft_model, token, cache, sites, queries, temperature)
        done += 1
        yield done, total
    if question is not None:
        echo_question(draft_model, question, cache, sites, queries)
        done += 1
        yield done, total
    importance = importance_of(draft_model, sites, queries, cache, prompt_length, pool_kernel,
                               n_window)
    done += 1
    yield done, total
    return importance


def _next_token(logits: mx.array, temperature: float) -> mx.array:
    if temperature > 0:
        return mx.random.categorical(logits / temperature)[None]
    return mx.argmax(logits)[None]


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
    n_lookahead: int = N_LOOKAHEAD,
    pool_kernel: int = POOL_KERNEL,
    step_size: int = STEP_SIZE,
    temperature: float = 0.0,
    cancel_check: CancelCheck = None,
    n_window: int = N_WINDOW,
    question=None,
) -> mx.array:
    """Importance of every prompt token, shape (M,), float32.

    Lookahead is greedy unless `temperature` > 0. The draft's cache is dropped on
    return (MLX's buffer cache keeps the memory for the next request; nothing clears
    it on the hot path). `cancel_check()` runs between prefill chunks, lookahead steps
    and the final reduction, and may raise to abort. `question`: `score_steps`'.
    """
    steps = score_steps(draft_model, tokens, n_lookahead, pool_kernel, step_size, temperature,
                        n_window, question=question)
    return run_steps(steps, cancel_check)


@dataclass
class DraftScorer:
    """A draft model that shares the target's tokenizer, as a Scorer."""

    model: nn.Module
    n_lookahead: int = N_LOOKAHEAD
    pool_kernel: int = POOL_KERNEL
    step_size: int = STEP_SIZE
    temperature: float = 0.0
    n_window: int = N_WINDOW

    def score_steps(self, tokens: mx.array,
                    cache: Optional[list] = None) -> Generator[tuple, None, mx.array]:
        return score_steps(
            self.model, tokens, self.n_lookahead, self.pool_kernel, self.step_size,
            self.temperature, self.n_window, cache,
        )

    def score(self, tokens: mx.array, cancel_check: CancelCheck = None) -> mx.array:
        return run_steps(self.score_steps(tokens), cancel_check)
