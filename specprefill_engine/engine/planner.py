"""The planner: a request's prefill decisions, on rank 0: prefix-cache lookup, the SpecPrefill
decision, draft scoring, selection, and what the target must compute.

Each decision ends in fields of the request's state, which the worker turns into
plan operations: `scoring` (the draft's units, one per turn: its prompt chunks, the
capturing chunk, the lookahead steps, the reduction) and `prefill` (a `Feed`: a prefix
entry to restore and how many of its entries, the tokens to compute after them at
their true positions, in chunks).

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

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..core import UnsupportedModelError, select_chunks
from ..core.adapters import check_sparse_prefill_supported, sliding_window
from ..core.matching import question_match, with_matches
from ..core.prefill import chunk_cost, chunk_plan, prefill_weight
from ..core.scoring import check_score_arguments, score_plan
from ..core.sparse_prefill import cover_sliding_window
from .kv_store import checkpointed
from .plan import Feed, Restore, ScoreUnit, Store
from .policy import RECHECK_GAIN, expected_kept, predict, shapes_gain
from .prefix_cache import Hit, PrefixCache
from .runtime import Runtime
from .sampling import RowSampler
from .state import RequestState, Scoring, Status

logger = logging.getLogger(__name__)
REPLY_TOKENS = 512  # the most reply tokens a reuse decision counts decode for
FOLLOW_SLACK = 16  # tokens at a stored turn's end a next turn's template may render otherwise


@dataclass
class PrefixCaches:
    """The indexes of the target's prefix cache (dense and sparse entries) and of the
    draft's."""

    target: Optional[PrefixCache] = None
    draft: Optional[PrefixCache] = None


def caches_for(state: RequestState, caches: PrefixCaches) -> PrefixCaches:
    """The prefix caches a request reads and fills: none with `cache_prompt=False`."""
    return caches if state.cache_prompt else PrefixCaches()


def find_dense(state: RequestState, target: Optional[PrefixCache]) -> Optional[Hit]:
    """The longest prefix of the prompt a dense entry can be restored at."""
    return target.find(state.tokens, dense_only=True) if target is not None else None


def not_vouched(state: RequestState, runtime: Runtime) -> str:
    """Why the automatic policy must not engage the draft ("" when it may): its draft
    check (`vouch.py`) says it is not vouched for at the request's keep. The probe runs
    here, on the first prompt that would engage, if it never ran for this pair (its
    verdict is then saved for every later engine of the pair). It is not a plan
    operation: it runs once per pair, not per request, on its own caches, and the
    decision it feeds is this one, made now. A keep the caller gave is theirs:
    SpecPrefill runs, with a warning."""
    check = runtime.vouch
    if check is None:
        return ""
    if state.keep_given:
        check.warn_given(state.keep)
        return ""
    if check.pending:
        check.run(runtime.model, runtime.scorer.model, runtime.tokenizer)
    verdict = check.verdict(state.keep)
    return "" if verdict.vouched is not False else f"policy: draft not vouched for: {verdict.reason}"


def decide(state: RequestState, runtime: Runtime, caches: PrefixCaches,
           dense_hit: Optional[Hit]) -> tuple[bool, str]:
    """The request's choice, unless too little is left after `dense_hit`, a cached
    prefix; else the automatic policy: the threshold as a floor, then engage only where
    the predicted gain beats the margin and the draft is vouched for (`not_vouched`)."""
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
        if runtime.vouch is not None:
            runtime.vouch.warn_given(state.keep)
        return True, "requested"
    if length < state.threshold:
        return False, f"prompt below threshold ({length} < {state.threshold} tokens)"
    draft_hit = caches.draft.find(state.tokens) if caches.draft else None
    kept = expected_kept(length, state.keep, state.protected, config.chunk_size, config.tail_tokens)
    prediction = predict(runtime.costs, length, dense_hit.cut if dense_hit else 0,
                         draft_hit.cut if draft_hit else 0, kept)
    state.report.predicted_dense_s = prediction.dense_s
    state.report.predicted_specprefill_s = prediction.specprefill_s
    costs = runtime.costs
    if prediction.pays(config.specprefill_margin):
        declined = not_vouched(state, runtime)
        if declined:
            return False, declined
        costs.recheck.engaged()
        return True, f"policy: {prediction.describe()}"
    shapes = shapes_gain(costs, length, dense_hit.cut if dense_hit else 0,
                         draft_hit.cut if draft_hit else 0, kept)
    if shapes >= RECHECK_GAIN and costs.recheck.due():  # a wrong fit must not lock itself in
        declined = not_vouched(state, runtime)
        if declined:
            return False, declined
        return True, (f"policy: re-check: {prediction.describe()}, but the shapes alone "
                      f"predict {shapes:.2f}x")
    return False, f"policy: {prediction.describe()} ({prediction.shortfall(config.specprefill_margin)})"


def _set_feed(state: RequestState, runtime: Runtime, hit: Optional[Hit], cut: int,
              tokens: np.ndarray, positions: Optional[np.ndarray]) -> None:
    """What the target computes: `tokens` after `hit`'s entries before position `cut`."""
    restore = restore_of(state.handle, hit, cut)
    cached = restore.count
    weight = prefill_weight(runtime.model)
    chunk_ends = chunk_plan(int(tokens.size), cached, runtime.config.step_size, weight)
    checkpoints = {}
    if runtime.checkpointed:  # a cache that cannot be cut: a checkpoint at each boundary
        chunk_ends, checkpoints = split_at_boundaries(
            chunk_ends, state.boundaries, cut, tokens.size, positions)
    state.prefill = Feed(restore, tokens, positions, cached, chunk_ends, checkpoints)
    state.usage.cached_tokens = cached
    state.status = Status.PREFILLING


def restore_of(handle: int, hit: Optional[Hit], cut: int) -> Restore:
    """Restore `hit`'s entries before position `cut` for `handle` (nothing without a hit
    or a cut)."""
    if hit is None or cut <= 0:
        return Restore(handle)
    entry = hit.entry
    return Restore(handle, entry.key, cut, entry.count_before(cut), entry.held_before(cut))


def plan_dense(state: RequestState, runtime: Runtime, hit: Optional[Hit]) -> None:
    """From `hit` (`find_dense`'s: exactly the shared prefix on a plain model; a
    checkpoint at or before it on a hybrid or sliding-window one)."""
    cut = hit.cut if hit is not None else 0
    state.report.reuse = f"dense {hit.describe(cut)}" if cut else "none"
    state.positions = None
    state.densified = bool(cut) and hit.entry.densified  # the agent's next turns run as dense
    _set_feed(state, runtime, hit, cut, state.tokens[cut:], None)


def start_scoring(state: RequestState, runtime: Runtime, draft: Optional[PrefixCache]) -> None:
    """Score the whole prompt, reusing the draft's prefix cache: its units are the draft's
    prompt chunks from what the cache lacks, the chunk that captures the window's
    queries, the lookahead steps and the reduction, one per turn (`scoring_units`)."""
    check_sparse_prefill_supported(runtime.model)  # before spending the draft's time
    scorer, length = runtime.scorer, int(state.tokens.size)
    check_score_arguments(length, scorer.n_lookahead, scorer.n_window, scorer.step_size)
    hit = draft.find(state.tokens) if draft is not None else None
    cut = 0
    if hit is not None:  # the captured window must be fed anew
        cut = hit.entry.restorable(min(hit.cut, length - scorer.n_window))
        draft.touch(hit.entry.key)
    cut, capture_from = score_plan(length, cut, scorer.step_size, scorer.n_window,
                                   not checkpointed(scorer.model))
    restore = restore_of(state.handle, hit, cut)
    chunk_ends = chunk_plan(capture_from - cut, cut, scorer.step_size, 0.0)
    feed = Feed(restore, state.tokens[cut:capture_from], cached=cut, chunk_ends=chunk_ends)
    state.usage.draft_cached_tokens = cut
    state.scoring = Scoring(feed, state.tokens[capture_from:], scorer.n_lookahead - 1)
    state.status = Status.SCORING


def start_draft_feed(state: RequestState, runtime: Runtime,
                     draft: Optional[PrefixCache]) -> None:
    """The prompt's KV through the draft, from what its prefix cache holds, for a dense
    request whose reply the draft will propose: its prompt chunks, one unit per turn,
    then a reduction that captures nothing (`scoring_units`)."""
    scorer, length = runtime.scorer, int(state.tokens.size)
    hit = draft.find(state.tokens) if draft is not None else None
    cut = hit.entry.restorable(hit.cut) if hit is not None else 0
    if cut:
        draft.touch(hit.entry.key)
    restore = restore_of(state.handle, hit, cut)
    feed = Feed(restore, state.tokens[cut:], cached=cut,
                chunk_ends=chunk_plan(length - cut, cut, scorer.step_size, 0.0))
    state.usage.draft_cached_tokens = cut
    state.scoring = Scoring(feed, state.tokens[:0], 0)
    state.status = Status.SCORING


def scoring_units(state: RequestState, draft: Optional[PrefixCache]) -> list:
    """The draft's work for this turn: the next chunks up to a pause, else the capturing
    chunk, else a lookahead step, else the reduction (keeping the draft's cache in its
    prefix cache `draft`, if any; and for speculative decoding, for the reply)."""
    scoring, handle, length = state.scoring, state.handle, int(state.tokens.size)
    feed = scoring.feed
    first = feed.fed == 0 and not scoring.captured
    restore = feed.restore if first else None
    if not feed.done:
        units = [ScoreUnit(handle, length, chunk.tokens) for chunk in feed.unit()]
        units[0].restore = restore
        return units
    if not scoring.captured:
        scoring.captured = True
        if scoring.capture.size:
            return [ScoreUnit(handle, length, scoring.capture, restore, captures=True)]
    if scoring.lookahead:
        scoring.lookahead -= 1
        return [ScoreUnit(handle, length, lookahead=True)]
    store = None
    if draft is not None:
        store = Store(handle, state.tokens)
        draft.plan_store(store)
    return [ScoreUnit(handle, length, state.tokens, restore, reduce=True, store=store,
                      keep=state.speculative)]


def speculation(state: RequestState, runtime: Runtime, sampler: RowSampler,
                others: bool) -> tuple[bool, str]:
    """Whether the request's draft is to propose its reply (`num_draft_tokens`), and why
    ("" with the option off). Greedy rows with nothing that reads each step's logits,
    decoding alone: the reply is then plain decoding's."""
    count = state.num_draft_tokens
    if not count:
        return False, ""
    if runtime.speculative_reason:  # the engine's own setting was refused at load
        return False, f"off: {runtime.speculative_reason}"
    params = state.params
    if not params.greedy:
        return False, "off: sampling at temperature > 0 (the draft's proposals are greedy)"
    if sampler.processors:
        return False, "off: logits processors (a penalty, a response format or the caller's)"
    if params.logprobs is not None:
        return False, "off: logprobs asked"
    if others:
        return False, "off: other requests are running (they decode in one batch)"
    return True, f"{count} draft tokens a round"


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


def _runs(indices: np.ndarray) -> int:
    """Contiguous runs in sorted token indices (the passages they make)."""
    return int(indices.size and 1 + np.count_nonzero(np.diff(indices) > 1))


def _repair_pays(runtime: Runtime, state: RequestState, repair: tuple, fresh: tuple,
                 passages: bool) -> bool:
    """Repairing a stored view against selecting anew, each (tokens to prefill, entries
    cached before them, entries decode then attends over), by the cost model: their
    prefill (with `passages` to add, at the rate repairs ran here), plus decode over the
    entries each leaves for the reply."""
    costs, reply = runtime.costs, min(state.max_tokens, REPLY_TOKENS)

    def seconds(kind: str, feed: int, cached: int, kept: int) -> float:
        return costs.predict(kind, feed, cached) + reply * (
            costs.predict("target", 1, kept) - costs.predict("target", 1, 0))

    return seconds("repair" if passages else "target", *repair) <= seconds("target", *fresh)


def plan_sparse(state: RequestState, runtime: Runtime, caches: PrefixCaches,
                importance: np.ndarray) -> None:
    """Selection over the whole prompt, then what of the prefix cache can be reused. A
    dense prefix already cached is kept whole (its KV costs nothing) and `keep` applies
    to the rest. A stored sparse view of the shared prefix is repaired: the passages the
    new selection wants and the view lacks are fed at their true positions, then the new
    tokens, unless selecting anew is predicted cheaper; then the view is still extended as
    it is where it covers `reuse_coverage` of the top of the new importance. Hybrid and
    sliding-window caches cannot take passages out of order: there the view is reused
    behind that gate, or the prompt selected anew."""
    config, report, tokens = runtime.config, state.report, state.tokens
    length = tokens.size
    target = caches.target
    if config.match_weight:
        importance = with_matches(importance, question_match(
            *runtime.words(tokens), min(config.n_window, length)), config.match_weight)
    dense_hit = target.find(tokens, dense_only=True) if target is not None else None
    must_keep = state.protected
    if dense_hit is not None:
        cached = np.arange(length) < dense_hit.cut
        must_keep = cached if must_keep is None else (must_keep | cached)
    selected = np.asarray(select_chunks(
        importance, report.keep, config.chunk_size, config.backbone_pct, config.tail_tokens,
        must_keep=must_keep, spread=config.spread,
    ), dtype=np.int64)
    probe = make_prompt_cache(runtime.model)
    window = sliding_window(probe)
    selected = cover_sliding_window(selected, probe, length, 0)

    # what can be reused: the dense prefix, or a stored sparse view of a longer prefix
    cut, before, reuse, hit = 0, np.zeros(0, np.int64), "none", None
    added = np.zeros(0, np.int64)  # passages a repair adds to the view
    if target is not None:
        if dense_hit is not None:
            # selected is sorted: the first index where it departs from 0, 1, 2, ...
            # is the first dropped position
            dropped = np.flatnonzero(selected != np.arange(selected.size))
            first_dropped = int(dropped[0]) if dropped.size else int(selected.size)
            cut = dense_hit.entry.restorable(min(dense_hit.cut, first_dropped))
            hit, before = dense_hit, np.arange(cut)
            reuse = f"dense {dense_hit.describe(cut)}" if cut else "none"
        # a stored view reaching further than the dense prefix (one being densified, say);
        # a sliding-window layer's last window is fed anew (the view may lack some of it)
        sparse_hit = target.find(tokens)
        entry = sparse_hit.entry if sparse_hit is not None else None
        shared = 0 if entry is None else entry.restorable(
            min(sparse_hit.cut, length - window) if window else sparse_hit.cut)
        if entry is not None and entry.positions is not None and shared > cut:
            held = entry.positions[: entry.count_before(shared)]
            wanted = selected[selected < shared]
            coverage = _coverage(importance, wanted, held)
            missing = np.setdiff1d(wanted, held)
            view = f"sparse {sparse_hit.describe(shared)}, coverage {coverage:.2f}"
            if runtime.checkpointed:  # in-order caches: the view as it is, behind the gate
                if coverage >= config.reuse_coverage and entry.keep >= report.keep:
                    cut, hit, before = shared, sparse_hit, held
                    reuse = f"{view} >= {config.reuse_coverage}"
                else:
                    reuse = (f"selected anew: a stored selection covers {coverage:.2f} of the "
                             f"shared prefix's importance at keep {entry.keep} (a hybrid or "
                             f"sliding-window cache cannot be repaired); {reuse}")
            else:
                new = int(np.count_nonzero(selected >= shared))
                fresh = int(np.count_nonzero(selected >= cut))
                kept = held.size + missing.size + new
                repair = _repair_pays(runtime, state, (missing.size + new, held.size, kept),
                                      (fresh, cut, selected.size), bool(missing.size))
                if repair or coverage >= config.reuse_coverage:
                    cut, hit, before = shared, sparse_hit, held
                    reuse = view
                    if repair and missing.size:
                        added = missing
                        reuse += (f", repaired: +{_runs(missing)} chunks "
                                  f"({missing.size} tokens)")
                    elif missing.size:  # the gate holds the top of the importance
                        reuse += f" >= {config.reuse_coverage}, extended as it is"
                else:
                    reuse = (f"selected anew: repairing the stored view ({missing.size + new} "
                             f"tokens after {held.size} entries, repairs running "
                             f"{runtime.costs.repair_factor():.1f}x a causal prefill here) is "
                             f"predicted slower than selecting anew ({fresh} tokens); {reuse}")
    report.reuse = reuse
    state.repaired = int(added.size)
    kept_new = np.concatenate([added, selected[selected >= cut]])
    positions = np.concatenate([before, kept_new])
    report.kept_tokens = int(positions.size)
    report.selection_digest = hashlib.sha1(np.sort(positions).tobytes()).hexdigest()[:16]
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
    state.scoring, state.repaired = None, 0
    if state.speculative:  # the draft's cache may have gone with the failure
        state.speculative = False
        report.speculative = "off: SpecPrefill's own step failed"
    plan_dense(state, runtime, find_dense(state, caches.target))


def promote(state: RequestState, runtime: Runtime, caches: PrefixCaches) -> list:
    """Before any lookup: what the disk tiers hold beyond memory, to read back where that
    pays (`Load`s, run before the request is admitted). A dense prefix for every request;
    for one that may be scored, any stored view and the draft's prompt KV too."""
    caches = caches_for(state, caches)
    target, draft = caches.target, caches.draft
    loads = [target.promote(state.tokens, dense_only=True)] if target is not None else []
    if runtime.scorer is not None and state.specprefill is not False:
        if target is not None:
            loads.append(target.promote(state.tokens))
        if draft is not None:
            load = draft.promote(state.tokens)
            if load is not None:
                load.draft = True
            loads.append(load)
    return [load for load in loads if load is not None]


def follows_sparse(state: RequestState, target: Optional[PrefixCache],
                   dense_hit: Optional[Hit]) -> int:
    """The length of a stored SpecPrefill turn this request continues beyond its dense
    prefix (a conversation's next turn, the cost model's follow-ups), else 0. It must hold
    the whole turn, prompt and reply (up to `FOLLOW_SLACK` tokens its chat template may
    render otherwise), and go on past it: a retried prompt, a sibling request with the
    same system prompt or document, continues no turn."""
    hit = target.find(state.tokens) if target is not None else None
    if hit is None or hit.entry.positions is None:
        return 0
    stored = hit.entry.tokens.size
    if hit.shared < stored - FOLLOW_SLACK or state.tokens.size <= stored:
        return 0
    return hit.shared if hit.shared > (dense_hit.cut if dense_hit else 0) else 0


def begin(state: RequestState, runtime: Runtime, caches: PrefixCaches) -> None:
    """Decide the request's prefill: scoring (then `plan_sparse`) or a dense feed, after
    the draft's own feed of the prompt when it is to propose the reply."""
    caches = caches_for(state, caches)
    dense_hit = find_dense(state, caches.target)
    if runtime.scorer is not None:  # without a draft no SpecPrefill turn is stored
        state.follows = follows_sparse(state, caches.target, dense_hit)
    report = state.report
    report.engaged, report.reason = decide(state, runtime, caches, dense_hit)
    if report.engaged:
        try:
            start_scoring(state, runtime, caches.draft)
            return
        except Exception as error:
            fall_back_to_dense(state, runtime, caches, error)
            return
    if state.speculative:
        start_draft_feed(state, runtime, caches.draft)
        return
    plan_dense(state, runtime, dense_hit)


def split_at_boundaries(chunk_ends: list, boundaries: tuple, cut: int, size: int,
                        positions: Optional[np.ndarray]) -> tuple[list, dict]:
    """Chunk ends that also stop at each chat boundary past `cut` (where every entry
    before it is fed and none after), and the prompt length each such end stands for,
    so the executor can snapshot the cache there; no turn is added."""
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
