"""A request's prefill decisions, on rank 0: prefix-cache lookup, the SpecPrefill
decision, draft scoring, selection, and what the target must compute.

Each decision ends in fields of the request's state, which the scheduler turns into
plan chunks: `restore` (a prefix entry and how many of its entries), `feed` (the
tokens to compute after them), `feed_positions` (their true positions; None: dense),
`chunk_ends`. Scoring runs on the draft alone, one unit per scheduler turn.

Across an agent's turns (see docs/how-it-works.md, "Agent turns"):
- the draft's prompt KV is kept, so scoring a grown prompt prefills only its new
  tokens through the draft (importance still covers every token);
- selection always runs over the whole prompt, on an absolute chunk grid, with the
  chat template's protected tokens; a dense prefix-cache hit is reused only up to the
  first token the selection drops, so the kept set is that of a fresh engine (and the
  KV too, up to float rounding: continuing from a prefix ends chunks elsewhere);
- a stored SpecPrefill cache (kept prompt entries and reply, with their positions) is
  reused for the shared prefix when its selection kept at least this request's `keep`
  and the new importance says it still covers what matters there (`reuse_coverage`);
  otherwise the prompt is selected anew.
"""

import hashlib
import logging
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..core import UnsupportedModelError, select_chunks
from ..core.adapters import check_sparse_prefill_supported, sliding_window
from ..core.prefill import chunk_cost, chunk_plan, prefill_weight
from ..core.sparse_prefill import cover_sliding_window
from .plan import Chunk, Restore
from .policy import expected_kept, predict
from .prefix_cache import Hit, PrefixCache
from .runtime import Runtime
from .state import PREFILLING, SCORING, RequestState

logger = logging.getLogger(__name__)


@dataclass
class PrefixCaches:
    """The target's prefix cache (dense and sparse entries) and the draft's."""

    target: Optional[PrefixCache] = None
    draft: Optional[PrefixCache] = None


def caches_for(state: RequestState, caches: PrefixCaches) -> PrefixCaches:
    """The prefix caches a request reads and fills: none with `cache_prompt=False`."""
    return caches if state.cache_prompt else PrefixCaches()


def find_dense(state: RequestState, target: Optional[PrefixCache]) -> Optional[Hit]:
    """The longest prefix of the prompt a dense entry can be restored at."""
    return target.find(state.tokens, dense_only=True) if target is not None else None


def decide(state: RequestState, runtime: Runtime, caches: PrefixCaches,
           dense_hit: Optional[Hit]) -> tuple[bool, str]:
    """The request's choice, unless too little is left after `dense_hit`, a cached
    prefix; else the automatic policy: the threshold as a floor, then engage only where
    the predicted gain beats the margin."""
    if state.specprefill is False:
        return False, "disabled for this request"
    if runtime.scorer is None:
        return False, "no draft model configured"
    length, config = state.tokens.size, runtime.config
    floor = config.chunk_size + config.tail_tokens
    if state.specprefill is None or (dense_hit is not None and dense_hit.entry.densified):
        floor = max(floor, state.threshold)  # a densified prefix: a turn as dense would run it
    if dense_hit is not None and length - dense_hit.cut < floor:  # not worth the draft
        return False, (f"only {length - dense_hit.cut} tokens to prefill after a cached "
                       f"prefix of {dense_hit.cut}: too few to sparsify (< {floor}); "
                       "dense, not scored")
    if state.specprefill:
        return True, "requested"
    if length < state.threshold:
        return False, f"prompt below threshold ({length} < {state.threshold} tokens)"
    draft_hit = caches.draft.find(state.tokens) if caches.draft else None
    kept = expected_kept(length, state.keep, state.protected, config.chunk_size, config.tail_tokens)
    prediction = predict(runtime.costs, length, dense_hit.cut if dense_hit else 0,
                         draft_hit.cut if draft_hit else 0, kept)
    state.report.predicted_dense_s = prediction.dense_s
    state.report.predicted_specprefill_s = prediction.specprefill_s
    if not prediction.pays(config.specprefill_margin):
        return False, f"policy: {prediction.describe()} (< {1 + config.specprefill_margin:.2f}x)"
    return True, f"policy: {prediction.describe()}"


def _set_feed(state: RequestState, runtime: Runtime, hit: Optional[Hit], cut: int,
              feed: np.ndarray, positions: Optional[np.ndarray]) -> None:
    """What the target computes: `feed` after `hit`'s entries before position `cut`."""
    used = hit is not None and cut > 0
    state.restore = Restore(state.handle, hit.entry.key if used else -1, cut if used else 0)
    state.cached = hit.entry.count_before(cut) if used else 0
    state.feed, state.feed_positions, state.fed = feed, positions, 0
    weight = prefill_weight(runtime.model)
    state.chunk_ends = chunk_plan(int(feed.size), state.cached, runtime.config.step_size, weight)
    if runtime.checkpointed:  # a cache that cannot be cut: a checkpoint at each boundary
        state.chunk_ends, state.checkpoints = split_at_boundaries(
            state.chunk_ends, state.boundaries, cut, feed.size, positions)
    state.usage.cached_tokens = state.cached
    state.status = PREFILLING


def plan_dense(state: RequestState, runtime: Runtime, hit: Optional[Hit]) -> None:
    """From `hit` (`find_dense`'s: exactly the shared prefix on a plain model; a
    checkpoint at or before it on a hybrid or sliding-window one)."""
    cut = hit.cut if hit is not None else 0
    state.report.reuse = f"dense {hit.describe(cut)}" if cut else "none"
    state.positions = None
    state.densified = bool(cut) and hit.entry.densified  # the agent's next turns run as dense
    _set_feed(state, runtime, hit, cut, state.tokens[cut:], None)


def start_scoring(state: RequestState, runtime: Runtime, draft: Optional[PrefixCache]) -> None:
    """Score the whole prompt, reusing the draft's prefix cache; one unit per turn."""
    check_sparse_prefill_supported(runtime.model)  # before spending the draft's time
    hit = draft.find(state.tokens) if draft is not None else None
    cut = 0
    if hit is not None:  # the captured window must be fed anew
        cut = hit.entry.restorable(min(hit.cut, state.tokens.size - runtime.scorer.n_window))
        draft.touch(hit.entry.key)
    cache, _ = PrefixCache.restore(runtime.scorer.model, hit, cut)
    state.usage.draft_cached_tokens = cut
    state.scoring = runtime.scorer.score_steps(mx.array(state.tokens), cache)
    state.scoring_cache = cache
    state.status = SCORING


def score_unit(state: RequestState, runtime: Runtime,
               draft: Optional[PrefixCache]) -> Optional[np.ndarray]:
    """One unit of the draft's scoring; the importance once it is done. `state.scored`:
    prompt tokens through the draft so far, of all (its units are fixed-size chunks)."""
    done, total = next(state.scoring)
    length = int(state.tokens.size)
    tokens = state.usage.draft_cached_tokens + done * runtime.config.draft_step_size
    state.scored = (length if done == total else min(tokens, length - 1), length)
    if done < total:
        return None
    try:
        next(state.scoring)  # the last unit is done: take the importance it returns
    except StopIteration as finished:
        importance = np.array(finished.value, dtype=np.float32)
    else:
        raise RuntimeError("scoring went on past its last unit")
    state.scoring = None
    cache, state.scoring_cache = state.scoring_cache, None
    if draft is not None:  # the draft's cache is rank 0's alone: its budget is kept here
        key = draft.store(state.tokens, cache)
        if key is not None:  # its only store for this prompt: kept on disk too
            draft.persist(key)
        for key in draft.evictions():
            draft.persist(key)
            draft.drop(key)
    return importance


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


def plan_sparse(state: RequestState, runtime: Runtime, caches: PrefixCaches,
                importance: np.ndarray) -> None:
    """Selection over the whole prompt, then what of the prefix cache can be reused. A
    dense prefix already cached is kept whole (its KV costs nothing) and `keep` applies
    to the rest."""
    config, report, tokens = runtime.config, state.report, state.tokens
    length = tokens.size
    target = caches.target
    dense_hit = target.find(tokens, dense_only=True) if target is not None else None
    must_keep = state.protected
    if dense_hit is not None:
        cached = np.arange(length) < dense_hit.cut
        must_keep = cached if must_keep is None else (must_keep | cached)
    selected = np.asarray(select_chunks(
        importance, report.keep, config.chunk_size, config.backbone_pct, config.tail_tokens,
        must_keep=must_keep,
    ), dtype=np.int64)
    probe = make_prompt_cache(runtime.model)
    window = sliding_window(probe)
    selected = cover_sliding_window(selected, probe, length, 0)

    # what can be reused: the dense prefix, or a stored sparse cache whose selection
    # kept as much and still covers the shared prefix
    cut, before, reuse, hit = 0, np.zeros(0, np.int64), "none", None
    if target is not None:
        if dense_hit is not None:
            # selected is sorted: the first index where it departs from 0, 1, 2, ...
            # is the first dropped position
            dropped = np.flatnonzero(selected != np.arange(selected.size))
            first_dropped = int(dropped[0]) if dropped.size else int(selected.size)
            cut = dense_hit.entry.restorable(min(dense_hit.cut, first_dropped))
            hit, before = dense_hit, np.arange(cut)
            reuse = f"dense {dense_hit.describe(cut)}" if cut else "none"
        # a stored view reaching further than the dense prefix (one being densified, say),
        # behind the gate; a sliding-window layer's last window is fed anew (the view may
        # lack some of it)
        sparse_hit = target.find(tokens)
        entry = sparse_hit.entry if sparse_hit is not None else None
        shared = 0 if entry is None else entry.restorable(
            min(sparse_hit.cut, length - window) if window else sparse_hit.cut)
        if entry is not None and entry.positions is not None and shared > cut:
            held = entry.positions[entry.positions < shared]
            if entry.keep < report.keep:
                reuse = (f"selected anew: a stored selection kept {entry.keep} of the prompt, "
                         f"less than this request's keep {report.keep}; {reuse}")
            else:
                coverage = _coverage(importance, selected[selected < shared], held)
                if coverage >= config.reuse_coverage:
                    cut, hit, before = shared, sparse_hit, held
                    reuse = (f"sparse {sparse_hit.describe(shared)}, "
                             f"coverage {coverage:.2f} >= {config.reuse_coverage}")
                else:
                    reuse = (f"selected anew: a stored selection covers {coverage:.2f} of the "
                             f"shared prefix's importance (< {config.reuse_coverage}); {reuse}")
    report.reuse = reuse
    kept_new = selected[selected >= cut]
    positions = np.concatenate([before, kept_new])
    report.kept_tokens = int(positions.size)
    report.selection_digest = hashlib.sha1(positions.astype(np.int64).tobytes()).hexdigest()[:16]
    state.positions = None if np.array_equal(positions, np.arange(length)) else positions
    _set_feed(state, runtime, hit, cut, tokens[kept_new], kept_new)


def fall_back_to_dense(state: RequestState, runtime: Runtime, caches: PrefixCaches,
                       error: BaseException) -> None:
    """Any failure of SpecPrefill's own steps (scoring, selection) or an unsupported
    model: the request prefills densely and its report says why."""
    if not isinstance(error, UnsupportedModelError):
        logger.warning("request %s: SpecPrefill failed, dense prefill instead: %r", state.id,
                       error)
    report = state.report
    report.engaged = False
    report.reason = f"fell back to dense prefill: {error}"
    report.kept_tokens = int(state.tokens.size)
    state.scoring = state.scoring_cache = None
    plan_dense(state, runtime, find_dense(state, caches.target))


def promote(state: RequestState, runtime: Runtime, caches: PrefixCaches) -> None:
    """Before any lookup: what the disk tiers hold beyond memory, read back where that
    pays. A dense prefix for every request; for one that may be scored, any stored view
    and the draft's prompt KV too."""
    if caches.target is not None:
        caches.target.promote(state.tokens, dense_only=True)
    if runtime.scorer is None or state.specprefill is False:
        return
    if caches.target is not None:
        caches.target.promote(state.tokens)
    if caches.draft is not None:
        caches.draft.promote(state.tokens)


def begin(state: RequestState, runtime: Runtime, caches: PrefixCaches) -> None:
    """Decide the request's prefill: scoring (then `plan_sparse`) or a dense feed."""
    caches = caches_for(state, caches)
    promote(state, runtime, caches)
    dense_hit = find_dense(state, caches.target)
    report = state.report
    report.engaged, report.reason = decide(state, runtime, caches, dense_hit)
    if report.engaged:
        try:
            start_scoring(state, runtime, caches.draft)
            return
        except Exception as error:
            fall_back_to_dense(state, runtime, caches, error)
            return
    plan_dense(state, runtime, dense_hit)


def split_at_boundaries(chunk_ends: list, boundaries: tuple, cut: int, size: int,
                        positions: Optional[np.ndarray]) -> tuple[list, dict]:
    """Chunk ends that also stop at each chat boundary past `cut` (where every entry
    before it is fed and none after), and the prompt length each such end stands for,
    so the executor can snapshot the cache there; no scheduler turn is added."""
    checkpoints = {}
    for boundary in boundaries:
        if boundary <= cut:
            continue
        end = boundary - cut if positions is None else int(np.searchsorted(positions, boundary))
        if 0 < end < size:
            checkpoints[end] = boundary
    ends = dict(chunk_ends)
    for end in checkpoints:
        ends.setdefault(end, False)
    return sorted(ends.items()), checkpoints


def unit_chunks(handle: int, feed: np.ndarray, positions: Optional[np.ndarray], fed: int,
                chunk_ends: list, checkpoint: int = 0, checkpoints: Optional[dict] = None
                ) -> tuple[list, int]:
    """One unit of prefill work from `fed` on: the chunks up to the first end a scheduler
    turn may follow (or the feed's end, whose chunk is `last` and carries `checkpoint`;
    `checkpoints` names the others that do), and how far the feed is then."""
    chunks, checkpoints = [], checkpoints or {}
    for end, pause in chunk_ends:
        if end <= fed:
            continue
        last = end == feed.size
        chunks.append(Chunk(handle, feed[fed:end], None if positions is None else positions[fed:end],
                            last=last, checkpoint=checkpoint if last else checkpoints.get(end, 0)))
        fed = end
        if pause or last:
            break
    return chunks, fed


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
