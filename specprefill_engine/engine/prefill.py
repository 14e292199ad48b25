"""A request's prefill on the worker, one unit of work per iteration: prefix-cache
lookup, the SpecPrefill decision, draft scoring, selection, target prefill.

Yields (phase, done, total) between units so the scheduler can run decode steps
and check for cancellation; returns (cache, last-token logits, decode shift).
"""

import logging
import time
from typing import Generator, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..core import UnsupportedModelError, chunked_prefill, select_chunks, sparse_prefill_steps
from ..core.adapters import check_sparse_prefill_supported
from ..core.sparse_prefill import cover_sliding_window
from .prefix_cache import PrefixCache
from .runtime import Runtime
from .state import RequestState

logger = logging.getLogger(__name__)


def _phase(name: str, steps: Generator) -> Generator:
    """Label a core step generator's (done, total) yields with the phase name."""
    while True:
        try:
            done, total = next(steps)
        except StopIteration as finished:
            return finished.value
        yield name, done, total


def _lookup(model, tokens, prefix_cache: Optional[PrefixCache]) -> tuple[list, int]:
    if prefix_cache is None:
        return make_prompt_cache(model), 0
    return prefix_cache.lookup(model, tokens)


def decide(state: RequestState, runtime: Runtime, suffix_length: int) -> tuple[bool, str]:
    if state.specprefill is False:
        return False, "disabled for this request"
    if runtime.scorer is None:
        return False, "no draft model configured"
    if state.specprefill is None and suffix_length < state.threshold:
        return False, f"prompt below threshold ({suffix_length} < {state.threshold} tokens)"
    return True, "engaged"


def _sparse(state: RequestState, runtime: Runtime, cache: list, cached: int) -> Generator:
    config, report = runtime.config, state.report
    check_sparse_prefill_supported(runtime.model)  # before spending the draft's time
    tokens = mx.array(state.tokens)
    scoring_started = time.perf_counter()
    importance = yield from _phase("scoring", runtime.scorer.score_steps(tokens))
    state.timings.scoring = time.perf_counter() - scoring_started
    selected = select_chunks(importance[cached:], report.keep, config.chunk_size,
                             config.backbone_pct, config.tail_tokens)
    selected = cover_sliding_window(selected, cache, tokens.size - cached, cached)
    report.kept_tokens = int(selected.size)
    steps = sparse_prefill_steps(runtime.model, tokens[cached:], selected, cache,
                                 config.step_size, cached)
    return (yield from _phase("prefill", steps))


def prefill_steps(state: RequestState, runtime: Runtime,
                  prefix_cache: Optional[PrefixCache]) -> Generator:
    """SpecPrefill when the policy says so (dense when the model cannot take it)."""
    model, report = runtime.model, state.report
    if not state.cache_prompt:
        prefix_cache = None
    cache, cached = _lookup(model, state.tokens, prefix_cache)
    state.usage.cached_tokens = cached
    report.engaged, report.reason = decide(state, runtime, state.tokens.size - cached)
    if report.engaged:
        report.total_tokens = int(state.tokens.size) - cached
        try:
            logits, shift = yield from _sparse(state, runtime, cache, cached)
            return cache, logits, shift
        except UnsupportedModelError as error:
            logger.info("request %s: dense prefill, %s", state.id, error)
            report.engaged = False
            report.reason = f"fell back to dense prefill: {error}"
            report.kept_tokens = report.total_tokens = int(state.tokens.size)
            cache, cached = _lookup(model, state.tokens, prefix_cache)
            state.usage.cached_tokens = cached
    suffix = mx.array(state.tokens[cached:])
    steps = chunked_prefill(model, suffix, cache, runtime.config.step_size)
    logits = yield from _phase("prefill", steps)
    if prefix_cache is not None:
        prefix_cache.store(state.tokens, cache)
    return cache, logits, 0
