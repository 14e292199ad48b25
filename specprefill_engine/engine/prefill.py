"""A request's prefill on the worker, one unit of work per iteration: prefix-cache
lookup, the SpecPrefill decision, draft scoring, selection, target prefill.

Yields (phase, done, total) between units so the scheduler can run decode steps
and check for cancellation; returns (cache, last-token logits, decode shift) and
leaves in `state.positions` the position of every cache entry (None: 0..n-1).

Across an agent's turns (see README, "Agent turns"):
- the draft's prompt KV is kept, so scoring a grown prompt prefills only its new
  tokens through the draft (importance still covers every token);
- selection always runs over the whole prompt, on an absolute chunk grid, with the
  chat template's protected tokens; a dense prefix-cache hit is reused only up to the
  first token the selection drops, cut to the prefill chunk grid, so the kept set and
  the computed KV are those of a fresh engine: the answer does not depend on history;
- a stored SpecPrefill cache (kept prompt entries and reply, with their positions) is
  reused for the shared prefix when the new importance says its selection still
  covers what matters there (`reuse_coverage`); otherwise the prompt is selected anew.
"""

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Generator, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..core import UnsupportedModelError, chunked_prefill, select_chunks, sparse_prefill_steps
from ..core.prefill import chunk_cost, grid_cut, prefill_weight
from ..core.adapters import check_sparse_prefill_supported
from ..core.sparse_prefill import cover_sliding_window
from .distributed import FROM_PREFILL
from .policy import expected_kept, predict
from .prefix_cache import PrefixCache
from .runtime import Runtime
from .state import RequestState

logger = logging.getLogger(__name__)


@dataclass
class PrefixCaches:
    """The target's prefix cache (dense and sparse entries) and the draft's."""

    target: Optional[PrefixCache] = None
    draft: Optional[PrefixCache] = None


def _phase(name: str, steps: Generator, busy: Optional[list] = None) -> Generator:
    """Label a core step generator's (done, total) yields with the phase name;
    add the time spent inside it (not between units) to busy[0]."""
    while True:
        started = time.perf_counter()
        try:
            done, total = next(steps)
        except StopIteration as finished:
            return finished.value
        finally:
            if busy is not None:
                busy[0] += time.perf_counter() - started
        yield name, done, total


def decide(state: RequestState, runtime: Runtime, caches: PrefixCaches) -> tuple[bool, str]:
    """The request's choice, unless too little is left after a cached prefix; else the
    automatic policy: the threshold as a floor, then engage only where the predicted
    gain beats the margin."""
    if state.specprefill is False:
        return False, "disabled for this request"
    if runtime.scorer is None:
        return False, "no draft model configured"
    length, config = state.tokens.size, runtime.config
    dense_hit = caches.target.find(state.tokens, dense_only=True) if caches.target else None
    floor = config.chunk_size + config.tail_tokens
    if state.specprefill is None:
        floor = max(floor, state.threshold)
    if dense_hit is not None and length - dense_hit.shared < floor:  # not worth the draft
        return False, (f"only {length - dense_hit.shared} tokens to prefill after a cached "
                       f"prefix: too few to sparsify (< {floor}); dense, not scored")
    if state.specprefill:
        return True, "requested"
    if length < state.threshold:
        return False, f"prompt below threshold ({length} < {state.threshold} tokens)"
    costs = runtime.costs
    if not costs.calibrated:
        if runtime.leader is not None:
            runtime.leader.calibrate(config.step_size)
        costs.calibrate(runtime.model, runtime.scorer.model, config.step_size,
                        config.draft_step_size)
    draft_hit = caches.draft.find(state.tokens) if caches.draft else None
    kept = expected_kept(length, state.keep, state.protected, config.chunk_size, config.tail_tokens)
    prediction = predict(costs, length, dense_hit.shared if dense_hit else 0,
                         draft_hit.shared if draft_hit else 0, kept)
    state.report.predicted_dense_s = prediction.dense_s
    state.report.predicted_specprefill_s = prediction.specprefill_s
    if not prediction.pays(config.specprefill_margin):
        return False, f"policy: {prediction.describe()} (< {1 + config.specprefill_margin:.2f}x)"
    return True, f"policy: {prediction.describe()}"


def _dense(state: RequestState, runtime: Runtime, target: Optional[PrefixCache]) -> Generator:
    step = runtime.config.step_size
    hit = target.find(state.tokens, dense_only=True) if target is not None else None
    cut = grid_cut(hit.shared, step, prefill_weight(runtime.model)) if hit is not None else 0
    leader = runtime.leader
    if leader is not None:
        leader.restore(state.handle, hit, cut)
    cache, _ = PrefixCache.restore(runtime.model, hit, cut)
    state.usage.cached_tokens = cut
    state.report.reuse = f"dense prefix of {cut} tokens" if cut else "none"
    steps = chunked_prefill(runtime.model, mx.array(state.tokens[cut:]), cache, step)
    if leader is not None:
        steps = leader.prefill(state.handle, steps, state.tokens[cut:], step)
    busy = [0.0]
    logits = yield from _phase("prefill", steps, busy)
    runtime.costs.observe("target", state.tokens.size - cut, busy[0])
    state.positions = None
    if target is not None:
        key = target.store(state.tokens, cache)
        if leader is not None:
            leader.stored(target, FROM_PREFILL, state.handle, key, state.tokens.size)
    return cache, logits, 0


def _importance(state: RequestState, runtime: Runtime, draft: Optional[PrefixCache]) -> Generator:
    """Score the whole prompt, reusing (and refilling) the draft's prefix cache."""
    tokens = state.tokens
    hit = draft.find(tokens) if draft is not None else None
    cut = grid_cut(hit.shared, runtime.config.draft_step_size, 0.0) if hit is not None else 0
    cache, _ = PrefixCache.restore(runtime.scorer.model, hit, cut)
    state.usage.draft_cached_tokens = cut
    started, busy = time.perf_counter(), [0.0]
    steps = runtime.scorer.score_steps(mx.array(tokens), cache)
    importance = yield from _phase("scoring", steps, busy)
    state.timings.scoring = time.perf_counter() - started
    runtime.costs.observe("draft", tokens.size - cut, busy[0])
    if draft is not None:
        draft.store(tokens, cache)
    return np.array(importance, dtype=np.float32)


def _coverage(importance: np.ndarray, wanted: np.ndarray, held: np.ndarray,
              top_share: float = 0.1, floor: int = 32) -> float:
    """Share of the top importance mass that `held` has: over the most important
    tenth (at least `floor` tokens) of the tokens a fresh selection would keep. A
    question about a passage the stored selection dropped puts that passage at the
    top, so its absence shows here rather than being averaged away."""
    if wanted.size == 0:
        return 1.0
    count = min(wanted.size, max(floor, int(np.ceil(top_share * wanted.size))))
    top = wanted[np.argsort(-importance[wanted], kind="stable")[:count]]
    total = float(importance[top].sum())
    if total <= 0:
        return 1.0
    return float(importance[np.intersect1d(top, held)].sum()) / total


def _sparse(state: RequestState, runtime: Runtime, caches: PrefixCaches) -> Generator:
    config, report, tokens = runtime.config, state.report, state.tokens
    length = tokens.size
    check_sparse_prefill_supported(runtime.model)  # before spending the draft's time
    importance = yield from _importance(state, runtime, caches.draft)
    selected = np.asarray(select_chunks(
        importance, report.keep, config.chunk_size, config.backbone_pct, config.tail_tokens,
        must_keep=state.protected,
    ), dtype=np.int64)
    probe = make_prompt_cache(runtime.model)
    selected = cover_sliding_window(selected, probe, length, 0)

    # what can be reused: a dense prefix up to the first dropped token, or a stored
    # sparse cache whose selection still covers the shared prefix
    target, step = caches.target, config.step_size
    cut, before, reuse = 0, np.zeros(0, np.int64), "none"
    hit = None
    if target is not None:
        dense_hit = target.find(tokens, dense_only=True)
        if dense_hit is not None:
            # selected is sorted: the first index where it departs from 0, 1, 2, ...
            # is the first dropped position
            dropped = np.flatnonzero(selected != np.arange(selected.size))
            first_dropped = int(dropped[0]) if dropped.size else int(selected.size)
            cut = grid_cut(min(dense_hit.shared, first_dropped), step, prefill_weight(runtime.model))
            hit, before = dense_hit, np.arange(cut)
            reuse = f"dense prefix of {cut} tokens" if cut else "none"
        sparse_hit = target.find(tokens)
        if sparse_hit is not None and sparse_hit.entry.positions is not None \
                and sparse_hit.shared > cut:
            shared = sparse_hit.shared
            held = sparse_hit.entry.positions[sparse_hit.entry.positions < shared]
            coverage = _coverage(importance, selected[selected < shared], held)
            if coverage >= config.reuse_coverage:
                cut, hit, before = shared, sparse_hit, held
                reuse = (f"sparse prefix of {shared} tokens ({held.size} entries), "
                         f"coverage {coverage:.2f} >= {config.reuse_coverage}")
            else:
                reuse = (f"selected anew: a stored selection covers {coverage:.2f} of the "
                         f"shared prefix's importance (< {config.reuse_coverage}); {reuse}")
    leader = runtime.leader
    if leader is not None:
        leader.restore(state.handle, hit, cut)
    cache, _ = PrefixCache.restore(runtime.model, hit, cut)
    state.usage.cached_tokens = int(before.size)
    report.reuse = reuse
    kept_new = selected[selected >= cut]
    report.kept_tokens = int(before.size + kept_new.size)
    steps = sparse_prefill_steps(runtime.model, mx.array(tokens[cut:]), kept_new - cut, cache,
                                 step, cut)
    if leader is not None:
        steps = leader.prefill(state.handle, steps, tokens[cut:], step, kept_new - cut, cut)
    busy = [0.0]
    logits, shift = yield from _phase("prefill", steps, busy)
    runtime.costs.observe("target", int(kept_new.size), busy[0])
    positions = np.concatenate([before, kept_new])
    report.selection_digest = hashlib.sha1(positions.astype(np.int64).tobytes()).hexdigest()[:16]
    state.positions = None if np.array_equal(positions, np.arange(length)) else positions
    return cache, logits, shift


def short_prefill_share(state: RequestState, runtime: Runtime) -> Optional[float]:
    """A request's whole prefill as a share of one unit's cost (`chunk_cost`), when it is
    surely dense and fits one chunk; None otherwise (it may be scored by the draft, or
    it spans units)."""
    length, config = int(state.tokens.size), runtime.config
    may_score = runtime.scorer is not None and (
        state.specprefill is True or (state.specprefill is None and length >= state.threshold))
    if may_score or length > config.step_size:
        return None
    weight = prefill_weight(runtime.model)
    return chunk_cost(length, 0, weight) / chunk_cost(config.step_size, 0, weight)


def prefill_steps(state: RequestState, runtime: Runtime, caches: PrefixCaches) -> Generator:
    """SpecPrefill when the policy says so (dense when the model cannot take it)."""
    report = state.report
    if not state.cache_prompt:
        caches = PrefixCaches()
    report.engaged, report.reason = decide(state, runtime, caches)
    if report.engaged:
        try:
            return (yield from _sparse(state, runtime, caches))
        except UnsupportedModelError as error:
            logger.info("request %s: dense prefill, %s", state.id, error)
            report.engaged = False
            report.reason = f"fell back to dense prefill: {error}"
            report.kept_tokens = int(state.tokens.size)
    return (yield from _dense(state, runtime, caches.target))
