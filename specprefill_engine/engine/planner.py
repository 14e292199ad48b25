"""The planner: a request's prefill decisions, on rank 0: prefix-cache lookup, the SpecPrefill
decision, draft scoring, selection, and what the target must compute.

Each decision ends in fields of the request's state, which the worker turns into
plan operations: `scoring` (the draft's units, one per turn: its prompt chunks, the
capturing chunk, the lookahead steps, the reduction) and `prefill` (a `Feed`: a prefix
entry to restore and how many of its entries, the tokens to compute after them at
their true positions, in chunks).

A selection is a function of the prompt (see docs/how-it-works.md, "Agent turns"):
- importance comes from the draft's attention; the draft's prompt KV is kept, and a
  scoring restores it only at a point of its chunk grid, so the chunks, and the
  importance, are a fresh draft's;
- selection runs over the whole prompt, on an absolute chunk grid, with the chat
  template's protected tokens; nothing cached changes it;
- a cached entry, dense or sparse, is restored up to the first position where its kept
  entries depart from the selection: caches make a prefill shorter, never different.
Two documented reuses, each named in the report: the same request again follows its
first decision (`decisions.py`), and a conversation's next turn, a prompt that holds a
stored SpecPrefill turn's prompt whole and goes on, extends that turn's view (with its
reply as far as the new prompt agrees with it):
as it is where it kept at least this request's `keep` and covers `reuse_coverage` of
the top of the new importance, else with the passages the new selection wants added at
their true positions (a hybrid or sliding-window cache cannot take them out of order:
the prompt is selected anew there).
"""

import hashlib
import logging
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..core import UnsupportedModelError, select_chunks
from ..core.adapters import check_sparse_prefill_supported, sliding_window
from ..core.kinds import content_kind
from ..core.matching import question_match, with_matches
from ..core.prefill import chunk_cost, chunk_plan, prefill_weight
from ..core.scoring import capture_start, check_score_arguments, score_plan
from ..core.sparse_prefill import cover_sliding_window
from .decisions import DENSE, request_key
from .kv_store import checkpointed
from .plan import Feed, ScoreUnit, Store
from .policy import expected_kept, predict, shapes_gain
from .prefix_cache import Hit, PrefixIndex, PrefixIndexes, restore_of
from .runtime import Runtime
from .sampling import RowSampler
from .state import RequestState, Scoring

logger = logging.getLogger(__name__)
REPAIR_SLOWDOWN_CUDA = 5.8  # a masked forward against a causal one, per token, measured


def caches_for(state: RequestState, caches: PrefixIndexes) -> PrefixIndexes:
    """The prefix caches a request reads and fills: none with `cache_prompt=False`."""
    return caches if state.cache_prompt else PrefixIndexes()


def find_dense(state: RequestState, target: Optional[PrefixIndex]) -> Optional[Hit]:
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
    verdict = check.verdict(state.keep, prompt_kind(state, runtime), int(state.tokens.size))
    return "" if verdict.vouched is not False else f"policy: draft not vouched for: {verdict.reason}"


def prompt_kind(state: RequestState, runtime: Runtime) -> str:
    """Code or prose (`core/kinds.py`), over what the selection may drop: the prompt
    less its protected tokens."""
    tokens = state.tokens if state.protected is None else state.tokens[~state.protected]
    return content_kind(runtime.tokenizer.decode(tokens.tolist()))


def sparsify_floor(state: RequestState, runtime: Runtime, dense_hit: Optional[Hit]) -> int:
    """The fewest tokens left after a cached prefix that are worth the draft: a chunk
    and the tail, and for the automatic policy (or after a densified prefix, which a
    turn as dense would run) the threshold."""
    floor = runtime.config.chunk_size + runtime.config.tail_tokens
    if state.specprefill is None or (dense_hit is not None and dense_hit.entry.densified):
        floor = max(floor, state.threshold)
    return floor


def decide(state: RequestState, runtime: Runtime, caches: PrefixIndexes,
           dense_hit: Optional[Hit], continues: bool) -> tuple[bool, str]:
    """The request's choice, unless too little is left after `dense_hit`, a cached
    prefix, for the automatic policy or a conversation's next turn (`continues`); else
    the automatic policy: the threshold as a floor, then engage only where the predicted
    gain beats the margin and the draft is vouched for (`not_vouched`). A request that
    asks for SpecPrefill and continues no turn is selected whatever is cached."""
    if state.specprefill is False:
        return False, "disabled for this request"
    if runtime.scorer is None:
        return False, "no draft model configured"
    length, config = state.tokens.size, runtime.config
    floor = sparsify_floor(state, runtime, dense_hit)
    if dense_hit is not None and (continues or state.specprefill is None) \
            and length - dense_hit.cut < floor:  # not worth the draft
        return False, (f"only {length - dense_hit.cut} tokens to prefill after a cached "
                       f"prefix of {dense_hit.cut}: too few to sparsify (< {floor}); "
                       "dense, not scored")
    earlier = runtime.decisions.dense_prefix(state.tokens) if state.specprefill is None else 0
    if earlier and length - earlier < floor:  # the same, cached or not (an evicted turn)
        return False, (f"only {length - earlier} tokens after an earlier turn of {earlier} "
                       f"run dense: too few to sparsify (< {floor}); dense, not scored")
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
    if prediction.worth_rechecking(shapes) and costs.recheck.due():  # a wrong fit, not locked in
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
            chunk_ends, restore_points(state, runtime), cut, tokens.size, positions)
    state.prefill = Feed(restore, tokens, positions, cached, chunk_ends, checkpoints)
    state.usage.cached_tokens = cached


def restore_points(state: RequestState, runtime: Runtime) -> tuple:
    """Where a cache that cannot be cut keeps checkpoints: each chat boundary and, with
    sliding windows, the chunk grid's last point a window before the prompt's end, where
    a next turn, which feeds its own last window anew, can restore from."""
    window = sliding_window(make_prompt_cache(runtime.model))
    if not window:
        return state.boundaries
    step = runtime.config.chunk_size
    return (*state.boundaries, (int(state.tokens.size) - window) // step * step)


def plan_dense(state: RequestState, runtime: Runtime, hit: Optional[Hit]) -> None:
    """From `hit` (`find_dense`'s: exactly the shared prefix on a plain model; a
    checkpoint at or before it on a hybrid or sliding-window one)."""
    cut = hit.cut if hit is not None else 0
    state.report.reuse = f"dense {hit.describe(cut)}" if cut else "none"
    state.positions = None
    state.densified = bool(cut) and hit.entry.densified  # the agent's next turns run as dense
    _set_feed(state, runtime, hit, cut, state.tokens[cut:], None)


def start_scoring(state: RequestState, runtime: Runtime, draft: Optional[PrefixIndex],
                  exact: bool) -> None:
    """Score the whole prompt, reusing the draft's prefix cache: its units are the draft's
    prompt chunks from what the cache lacks, the chunk that captures the window's
    queries, the lookahead steps, the question's echo (`asked_tokens`) and the reduction,
    one per turn (`take_scoring_units`).
    `exact`: restore only on the draft's chunk grid (`on_draft_grid`); a conversation's
    next turn, whose view is a documented reuse, continues wherever the stored KV ends."""
    check_sparse_prefill_supported(runtime.model)  # before spending the draft's time
    scorer, length = runtime.scorer, int(state.tokens.size)
    check_score_arguments(length, scorer.n_lookahead, scorer.n_window, scorer.step_size)
    hit = draft.find(state.tokens) if draft is not None else None
    cut = 0
    if hit is not None:
        if exact and not checkpointed(scorer.model):
            cut = on_draft_grid(hit, length, scorer.step_size, scorer.n_window)
        else:  # continued from where the stored KV ends, or from a checkpoint
            cut = hit.entry.restorable(min(hit.cut, length - scorer.n_window))
        draft.touch(hit.entry.key)
    cut, capture_from = score_plan(length, cut, scorer.step_size, scorer.n_window,
                                   not checkpointed(scorer.model))
    restore = restore_of(state.handle, hit, cut)
    chunk_ends = chunk_plan(capture_from - cut, cut, scorer.step_size, 0.0)
    feed = Feed(restore, state.tokens[cut:capture_from], cached=cut, chunk_ends=chunk_ends)
    state.usage.draft_cached_tokens = cut
    state.scoring = Scoring(feed, state.tokens[capture_from:], scorer.n_lookahead - 1,
                            asked_tokens(state, scorer))


def asked_tokens(state: RequestState, scorer) -> np.ndarray:
    """The question's last `n_window` tokens, for the draft to read after the prompt
    (`core.scoring.echo_question`): none where the question ends the prompt, or where the
    draft's cache cannot be cut back to the prompt (its stored KV must end there)."""
    if state.question is None or checkpointed(scorer.model):
        return state.tokens[:0]
    return state.tokens[state.question[-scorer.n_window:]]


def on_draft_grid(hit: Hit, length: int, step_size: int, n_window: int) -> int:
    """Where a scoring may restore a plain draft's stored prompt KV: at a point of the
    chunk grid, before the stored prompt's own capturing chunk (every entry before it was
    then computed in the chunks a fresh draft computes it in, so the importance is a
    fresh draft's, bit for bit) and before this prompt's captured window (fed anew). A
    draft whose cache cannot be cut (hybrid, sliding window) is restored at a checkpoint
    instead: its importance is a fresh draft's up to float rounding."""
    stored = int(hit.entry.tokens.size)
    limit = min(hit.cut, length - n_window, capture_start(stored, step_size, n_window))
    return max(limit, 0) // step_size * step_size


def start_draft_feed(state: RequestState, runtime: Runtime,
                     draft: Optional[PrefixIndex]) -> None:
    """The prompt's KV through the draft, from what its prefix cache holds, for a dense
    request whose reply the draft will propose: its prompt chunks, one unit per turn,
    then a reduction that captures nothing (`take_scoring_units`)."""
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


def take_scoring_units(state: RequestState, draft: Optional[PrefixIndex]) -> list:
    """The draft's work for this turn, counted as done: the next chunks up to a pause,
    else the capturing chunk, else a lookahead step, else the question's echo, else the
    reduction (keeping the draft's cache in its prefix cache `draft`, if any; and for
    speculative decoding, for the reply)."""
    scoring, handle, length = state.scoring, state.handle, int(state.tokens.size)
    feed = scoring.feed
    first = feed.fed == 0 and not scoring.captured
    restore = feed.restore if first else None
    if not feed.done:
        units = [ScoreUnit(handle, length, chunk.tokens) for chunk in feed.take_unit()]
        units[0].restore = restore
        return units
    if not scoring.captured:
        scoring.captured = True
        if scoring.capture.size:
            return [ScoreUnit(handle, length, scoring.capture, restore, captures=True)]
    if scoring.lookahead:
        scoring.lookahead -= 1
        return [ScoreUnit(handle, length, lookahead=True)]
    if scoring.question.size and not scoring.asked:
        scoring.asked = True
        return [ScoreUnit(handle, length, scoring.question, echoes=True)]
    store = None
    if draft is not None:
        store = Store(handle, state.tokens)
        draft.plan_store(store)
    return [ScoreUnit(handle, length, state.tokens, restore, reduce=True, store=store,
                      keep_for_decode=state.speculative)]


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


def agreeing_restore(target: Optional[PrefixIndex], tokens: np.ndarray,
                     positions: np.ndarray) -> Optional[Hit]:
    """Of the cached entries, the one whose leading entries agree longest with the
    planned `positions` (in feed order): same tokens, same kept positions, fed in the
    same order, so its KV is what feeding them would compute. Its `cut` keeps those
    entries; the rest of `positions` is fed after them. A dense entry agrees up to the
    first position the plan drops. None when nothing agrees."""
    if target is None:
        return None
    best, length = None, int(tokens.size)
    for entry in target.entries.values():  # oldest first: the newest wins a tie
        n = min(entry.tokens.size, length - 1)
        if n <= 0:
            continue
        mismatch = np.flatnonzero(entry.tokens[:n] != tokens[:n])
        shared = int(mismatch[0]) if mismatch.size else n
        held = entry.positions if entry.positions is not None else np.arange(entry.tokens.size)
        m = min(held.size, positions.size)
        differ = np.flatnonzero(held[:m] != positions[:m])
        agree = int(differ[0]) if differ.size else m
        bound = int(held[agree]) if agree < held.size else int(entry.tokens.size)
        cut = entry.restorable(min(shared, bound))
        if cut > 0 and (best is None or cut >= best.cut):
            best = Hit(entry, shared, cut)
    return best


def continued_view(state: RequestState, runtime: Runtime, hit: Hit, importance: np.ndarray,
                   selected: np.ndarray) -> tuple[Optional[np.ndarray], str]:
    """A conversation's next turn (`hit`: the stored turn whose prompt it holds): the turn's
    view, extended with the selection past it, and the passages of the selection it
    lacks added at their true positions unless it kept at least `keep` and holds
    `reuse_coverage` of the top of the importance: (positions in feed order, what the
    report says); positions None: selected anew (a cache that cannot take passages out
    of order). A dense turn's view is every position: kept whole."""
    config, entry, length = runtime.config, hit.entry, int(state.tokens.size)
    window = sliding_window(make_prompt_cache(runtime.model))
    shared = entry.restorable(min(hit.cut, length - window) if window else hit.cut)
    held = entry.positions[: entry.count_before(shared)] if entry.positions is not None \
        else np.arange(shared)
    wanted = selected[selected < shared]
    coverage = _coverage(importance, wanted, held)
    missing = np.setdiff1d(wanted, held)
    new = selected[selected >= shared]
    view = f"the previous turn's view, coverage {coverage:.2f}"
    if not missing.size or (entry.keep >= state.keep
                            and coverage >= config.reuse_coverage):
        gate = f" >= {config.reuse_coverage}, extended as it is" if missing.size else ""
        return np.concatenate([held, new]), view + gate
    if runtime.checkpointed:
        return None, (f"selected anew: the previous turn's view covers {coverage:.2f} of "
                      f"the shared prefix's importance at keep {entry.keep} (a hybrid or "
                      f"sliding-window cache cannot be repaired)")
    common = min(held.size, selected.size)
    differ = np.flatnonzero(held[:common] != selected[:common])
    fresh = int(selected.size - (differ[0] if differ.size else common))
    slowdown = repair_slowdown()
    if not repair_pays(int(missing.size + new.size), fresh, slowdown):
        return None, (f"selected anew: repairing the previous turn's view ({missing.size} + "
                      f"{new.size} tokens, a masked forward costing {slowdown:g}x a causal "
                      f"one on this device) costs more than selecting anew ({fresh} tokens)")
    return (np.concatenate([held, missing, new]),
            f"{view}, repaired: +{_runs(missing)} chunks ({missing.size} tokens)")


def repair_slowdown() -> float:
    """How much a forward through a mask by position costs against a causal one, per
    token, by device (a constant, so a turn's plan never depends on what was measured
    before): about 1x on a CPU, 5.8x on a CUDA GPU, whose fused attention takes only
    causal masks (docs/how-it-works.md, "A sparse turn is repaired")."""
    cuda = mx.default_device() == mx.gpu and not mx.metal.is_available()
    return REPAIR_SLOWDOWN_CUDA if cuda else 1.0


def repair_pays(repaired: int, fresh: int, slowdown: float) -> bool:
    """Repairing a view (`repaired` tokens fed through a mask by position) against
    selecting anew (`fresh` tokens fed causally)."""
    return repaired * slowdown <= fresh


def plan_view(state: RequestState, runtime: Runtime, target: Optional[PrefixIndex],
              positions: np.ndarray, reuse: str = "") -> None:
    """Prefill the kept `positions` (in feed order): restored from the cached entry that
    agrees with them longest, the rest fed at their true positions."""
    tokens, length = state.tokens, int(state.tokens.size)
    hit = agreeing_restore(target, tokens, positions)
    cut = hit.cut if hit is not None else 0
    count = hit.entry.count_before(cut) if hit is not None else 0
    restored = f"{'sparse' if hit.entry.positions is not None else 'dense'} " \
        f"{hit.describe(cut)}" if hit is not None else "none"
    state.report.reuse = f"{restored}; {reuse}" if reuse else restored
    fed = positions[count:]
    late = np.zeros(positions.size, dtype=bool)  # fed after an entry of a later position
    late[1:] = positions[1:] < np.maximum.accumulate(positions)[:-1]
    state.repaired = int(np.count_nonzero(late[count:]))
    state.report.kept_tokens = int(positions.size)
    state.report.selection_digest = hashlib.sha1(
        np.sort(positions).astype(np.int64).tobytes()).hexdigest()[:16]
    state.positions = None if np.array_equal(positions, np.arange(length)) else positions
    _set_feed(state, runtime, hit, cut, tokens[fed], fed)


def plan_sparse(state: RequestState, runtime: Runtime, caches: PrefixIndexes,
                importance: np.ndarray) -> None:
    """Selection over the whole prompt (a function of the prompt: nothing cached changes
    it), or a conversation's next turn's view (`continued_view`); then prefilled from
    what of it is cached (`plan_view`), and the decision recorded for the same request
    again."""
    config, tokens = runtime.config, state.tokens
    length = tokens.size
    if config.match_weight:
        importance = with_matches(importance, question_match(
            *runtime.words(tokens), min(config.n_window, length), state.question),
            config.match_weight)
    starts = runtime.blank_lines(tokens) if runtime.blank_lines is not None else None
    selected = np.asarray(select_chunks(
        importance, state.keep, config.chunk_size, config.backbone_pct, config.tail_tokens,
        must_keep=state.protected, spread=config.spread, starts=starts,
    ), dtype=np.int64)
    selected = cover_sliding_window(selected, make_prompt_cache(runtime.model), length, 0)
    positions, reuse = selected, ""
    turn = followed_turn(state, caches.target)
    if turn is not None:
        view, reuse = continued_view(state, runtime, turn, importance, selected)
        if view is not None:
            positions = view
    plan_view(state, runtime, caches.target, positions, reuse)
    runtime.decisions.record(decision_key(state), positions)


def decision_key(state: RequestState) -> bytes:
    return request_key(state.tokens, state.specprefill, state.keep, state.keep_given,
                       state.threshold, state.protected, state.question)


def fall_back_to_dense(state: RequestState, runtime: Runtime, caches: PrefixIndexes,
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


def promote(state: RequestState, runtime: Runtime, caches: PrefixIndexes) -> list:
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


def followed_turn(state: RequestState, target: Optional[PrefixIndex]) -> Optional[Hit]:
    """The stored turn this request continues: a conversation's next turn holds a stored
    turn's prompt whole (which ends where the reply began) and goes on past it. Its reply
    may come back otherwise than the tokens generated (a template that re-renders tool
    calls or drops reasoning, a client that edits it): the view holds up to where they
    part. A retried prompt, or a sibling request with the same system prompt or document,
    continues no turn."""
    hit = target.find(state.tokens) if target is not None else None
    if hit is None or not 0 < hit.entry.prompt <= hit.shared:
        return None
    return hit if state.tokens.size > hit.shared else None


def begin(state: RequestState, runtime: Runtime, caches: PrefixIndexes) -> None:
    """Decide the request's prefill: as the same request before (`decisions.py`), else
    scoring (then `plan_sparse`) or a dense feed, after the draft's own feed of the
    prompt when it is to propose the reply."""
    caches = caches_for(state, caches)
    dense_hit = find_dense(state, caches.target)
    report = state.report
    turn = None
    if runtime.scorer is not None:  # without a draft no SpecPrefill turn is stored
        turn = followed_turn(state, caches.target)
        state.continues = turn.shared if turn is not None else 0
        state.follows = state.continues if turn is not None and \
            turn.entry.positions is not None else 0
        if state.specprefill is not False:
            earlier = runtime.decisions.get(decision_key(state))
            if earlier is not None:
                follow_decision(state, runtime, caches, earlier, dense_hit)
                return
    engaged, report.reason = decide(state, runtime, caches, dense_hit, turn is not None)
    report.engaged = engaged
    if engaged:
        try:
            start_scoring(state, runtime, caches.draft, exact=turn is None)
            return
        except Exception as error:
            fall_back_to_dense(state, runtime, caches, error)
            return
    if runtime.scorer is not None and state.specprefill is not False:
        runtime.decisions.record(decision_key(state), DENSE)
        if state.specprefill is None:
            runtime.decisions.ran_dense(state.tokens)
    if state.speculative:
        start_draft_feed(state, runtime, caches.draft)
        return
    plan_dense(state, runtime, dense_hit)


def follow_decision(state: RequestState, runtime: Runtime, caches: PrefixIndexes,
                    earlier, dense_hit: Optional[Hit]) -> None:
    """The same request again: dense, or the view it kept, as then (no draft scoring; the
    draft feeds the prompt first where it is to propose the reply)."""
    report, engaged = state.report, not isinstance(earlier, str)
    report.engaged = engaged
    if engaged:
        report.reason = "the same request as before: its kept positions again"
        state.view = earlier
    else:
        report.reason = "the same request as before: dense again"
    if state.speculative:
        start_draft_feed(state, runtime, caches.draft)
    elif engaged:
        plan_view(state, runtime, caches.target, earlier.astype(np.int64))
    else:
        plan_dense(state, runtime, dense_hit)


def after_draft_feed(state: RequestState, runtime: Runtime, caches: PrefixIndexes) -> None:
    """The draft holds the prompt's KV (to propose the reply): the target's prefill, the
    view the same request kept before or dense."""
    caches = caches_for(state, caches)
    if state.view is not None:
        plan_view(state, runtime, caches.target, state.view.astype(np.int64))
    else:
        plan_dense(state, runtime, find_dense(state, caches.target))


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


def short_prefill_share(state: RequestState, runtime: Runtime,
                        caches: PrefixIndexes) -> Optional[float]:
    """A request's whole prefill as a share of one unit's cost (`chunk_cost`), when it is
    surely dense and what is left after its cached prefix fits one chunk; None otherwise
    (it may be scored by the draft, or it spans units). Reads the prefix cache, changes
    nothing."""
    length, config = int(state.tokens.size), runtime.config
    if state.num_draft_tokens:
        return None  # the draft feeds the prompt first
    hit = find_dense(state, caches_for(state, caches).target)
    cached = hit.cut if hit is not None else 0
    may_score = runtime.scorer is not None and (
        state.specprefill is True or (state.specprefill is None and length >= state.threshold))
    if may_score and state.specprefill is None:
        earlier = runtime.decisions.get(decision_key(state))
        # as `begin` runs it: dense as before, or too few tokens after the cached prefix
        may_score = not isinstance(earlier, str) and (
            earlier is not None or hit is None
            or length - cached >= sparsify_floor(state, runtime, hit))
    if may_score or length - cached > config.step_size:
        return None
    weight = prefill_weight(runtime.model)
    return chunk_cost(length - cached, cached, weight) / chunk_cost(config.step_size, 0, weight)
