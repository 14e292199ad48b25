"""Runs a turn's plan: the same code on one process and on every rank.

The executor owns the tensors, one record per request handle (`_Row`, released in one
place): each prefilling request's target cache and the checkpoints taken on the way (models whose caches cannot be cut:
`kv_store.py`), the decode batch (and the solo decodes of a model that cannot
batch, and a row whose reply the draft proposes: `speculative.py`), the prefix cache's
tensors by the keys the plan names (`kv_store.KVStore`; the index is the planner's),
and on rank 0 the draft's caches while it scores (and while it proposes a reply), with
the draft's prefix-cache tensors, and the disk tier's reads and writes.
It knows nothing of requests beyond their handles and, on rank 0, how each is sampled
(`register`). It runs a `TurnPlan` in the plan's order and returns a `TurnOutcome`:
the tokens sampled (a prompt's first included), what each store and read kept, the
importance of a finished scoring, seconds spent, and per-handle errors.

Nothing a request does escapes `run`: a step, chunk or join that fails is that
request's error (a failed batched forward is every row's of that batch), a failed store
only leaves that cache out. On a sharded target the ranks agree after the turn's stores
and joins, which may fail on one rank alone (memory), so every rank undoes the same ones
(a failed store anywhere empties every rank's prefix cache, the one undo that keeps them
alike); a failure inside a prefill or decode forward leaves the ranks' collectives
apart, and is raised (the engine cannot go on).
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from ..core.prefill import align_buffers, cache_length, prefill_chunk
from ..core.quantized_kv import QuantizedKV, cut_cache
from ..core.scoring import (
    DraftScorer, capture_window, echo_question, importance_of, lookahead_step, scored_sites,
)
from ..core.sparse_prefill import decode_shift
from ..core.windows import SlidingWindows
from .batch import BatchLost, DecodeBatch, SoloDecode
from .kv_store import KVStore, checkpointed, snapshot
from .plan import Restore, TurnPlan
from .sampling import RowSampler, read_logprobs, sample_rows
from .speculative import SpeculativeDecode

logger = logging.getLogger(__name__)
_NO_TOKENS = mx.array([], dtype=mx.int32)  # what processors see before the first token


@dataclass
class TurnOutcome:
    tokens: list = field(default_factory=list)  # (handle, token, TokenLogprob or None)
    failed: dict = field(default_factory=dict)  # handle -> error
    # handle -> (checkpoint lengths, bytes) its store kept (absent: refused or failed)
    stored: dict = field(default_factory=dict)
    draft_stored: dict = field(default_factory=dict)  # the same, of the draft's store
    cleared: bool = False  # a store failed on some rank: every rank's prefix cache is emptied
    loaded: dict = field(default_factory=dict)  # (draft, key) -> bytes read, None: unreadable
    persisted: list = field(default_factory=list)  # (Persist, its file name or None)
    seconds: dict = field(default_factory=dict)  # handle -> time in its prefill chunks
    # handle -> its scoring's end: the importance (np.ndarray), None (the draft only
    # computed the prompt's KV) or SpecPrefill's own error
    scored: dict = field(default_factory=dict)
    scoring_seconds: dict = field(default_factory=dict)  # handle -> time in its scoring unit
    drafted: dict = field(default_factory=dict)  # handle -> (tokens proposed, taken): a round


@dataclass(eq=False)
class _Row:
    """One request's work on this rank, from its first plan (or its registration) to its
    release: everything the executor holds for it, dropped together."""

    sampler: Optional[RowSampler] = None  # how its tokens are sampled (rank 0)
    cache: Optional[list] = None  # the target's cache while prefilling
    snapshots: dict = field(default_factory=dict)  # prefix length -> Snapshot
    held: Optional[np.ndarray] = None  # positions of a restored sparse prefix's entries
    windows: Optional[SlidingWindows] = None  # its sparse prefill's sliding windows
    group: object = None  # once decoding: its DecodeBatch, SoloDecode or SpeculativeDecode
    scoring: Optional["_DraftWork"] = None  # the draft's scoring (rank 0)
    draft: Optional[list] = None  # the draft's cache of its prompt, for its reply


@dataclass
class _DraftWork:
    """A request's draft cache while it scores, and what the scoring captured."""

    cache: list
    sites: list
    queries: Optional[list] = None
    token: Optional[mx.array] = None  # the next lookahead input


class Executor:
    def __init__(self, model, prefix: Optional[KVStore], group=None, sampling: bool = True,
                 scorer: Optional[DraftScorer] = None, draft_prefix: Optional[KVStore] = None,
                 kv: Optional[QuantizedKV] = None):
        self.model = model
        self.kv = kv  # how the target's KV is quantized (the draft's never is: its scoring
        # reads its keys at the model's dtype); None: not
        self.prefix = prefix
        self.group = group  # a sharded target's process group
        self.sampling = sampling  # rank 0 samples; the other ranks follow its tokens
        self.scorer = scorer  # rank 0: the draft and its scoring settings
        self.draft_prefix = draft_prefix
        self.checkpointed = checkpointed(model)  # snapshots at message boundaries
        self.rows: dict = {}  # handle -> _Row
        self.batch = DecodeBatch(model, group, sampling)

    def register(self, handle: int, sampler: RowSampler) -> None:
        """How `handle`'s tokens are sampled (rank 0), before its first plan."""
        self._row(handle).sampler = sampler

    def _row(self, handle: int) -> _Row:
        """`handle`'s record, made on its first use."""
        return self.rows.setdefault(handle, _Row())

    def run(self, plan: TurnPlan) -> TurnOutcome:
        outcome = TurnOutcome()
        for persist in plan.persists:
            self._persist(persist, outcome)
        for load in plan.loads:
            self._load(load, outcome)
        named = {r.key for r in plan.restores}  # entries these restore from go after them
        later: list = []
        stored = [self._store(s, outcome, named, later) for s in plan.stores]
        clear = False
        for key in plan.drops:
            self._drop(key, named, later)
        for key in plan.draft_drops:
            self.draft_prefix.drop(key)
        for handle in plan.releases:
            self._release(handle)
        for handle in plan.demotions:
            self._demote(handle, outcome)
        joined = [self._join(j, outcome) for j in plan.joins]
        if self.group is not None and (plan.stores or plan.joins):
            clear = self._agree(plan, stored, joined, outcome)
        if plan.decode:
            self._decode(outcome)
        for entry in plan.restores:
            self._guard(outcome, entry.handle, self._restore, entry)
        for chunk in plan.chunks:
            if chunk.handle not in outcome.failed:
                self._guard(outcome, chunk.handle, self._chunk, chunk, outcome)
        for unit in plan.scoring:
            if unit.handle not in outcome.failed:
                self._score(unit, outcome)
        for key in later:
            self.prefix.drop(key)
        if clear:  # after this plan's restores, which name entries every rank holds
            self.prefix.clear()
        outcome.cleared = clear
        if outcome.failed:  # most often memory: MLX's buffers kept for reuse go back (a
            mx.clear_cache()  # failed forward's own arrays go once its error is dropped)
        return outcome

    def _guard(self, outcome: TurnOutcome, handle: int, work, *args) -> None:
        try:
            work(*args)
        except Exception as error:
            if self.group is not None:
                raise  # the other ranks run this request's forwards: they cannot agree now
            outcome.failed[handle] = error
            self._release(handle)

    # target work ----------------------------------------------------------------

    def _store(self, store, outcome: TurnOutcome, named: set, later: list) -> bool:
        """Keep a request's cache for its next turn, as the store says; the entries it
        absorbs go (those a restore in this plan names after it). A failure (a copy that
        cannot be allocated) only leaves it out."""
        handle = store.handle
        count = store.tokens.size if store.positions is None else store.positions.size
        try:
            row = self.rows[handle]
            if row.cache is not None:
                cache = row.cache if self.checkpointed else cut_cache(row.cache, count)
            else:
                cache = row.group.extract(handle, count)
            checkpoints = {length: snap for length, snap in row.snapshots.items()
                           if length <= store.tokens.size}
            held = self.prefix.put(store, cache, checkpoints)
            if held is not None:
                outcome.stored[handle] = (tuple(held.checkpoints), held.nbytes)
                for key in () if store.into else store.absorbs:
                    self._drop(key, named, later)
            return True
        except Exception as error:
            logger.warning("prefix-cache store of request #%d failed: %r", handle, error)
            return False

    def _drop(self, key: int, named: set, later: list) -> None:
        """Drop a prefix-cache entry now, or after this plan's restores if one names it."""
        if key in named:
            later.append(key)
        else:
            self.prefix.drop(key)

    def _release(self, handle: int) -> None:
        """The one place a request's work goes: its record, and its row of a decode."""
        row = self.rows.pop(handle, None)
        if row is not None and row.group is not None:
            row.group.remove({handle})

    def _join(self, join, outcome: TurnOutcome) -> bool:
        handle = join.handle
        row = self.rows[handle]
        try:
            cache = row.cache
            align_buffers(cache)
            shift = decode_shift(self.model, cache, join.length, 0)
            sampler = row.sampler
            draft_cache, row.draft = row.draft, None
            if join.speculative and draft_cache is not None:
                align_buffers(draft_cache)  # the draft decodes its proposals over it
                group = SpeculativeDecode(self.model, self.scorer.model, handle, cache,
                                          draft_cache, join.token, shift, join.speculative,
                                          self.kv)
            elif join.solo:
                group = SoloDecode(self.model, handle, sampler, cache, join.token, shift,
                                   self.group, self.sampling, self.kv)
            else:
                self.batch.add(handle, sampler, cache, join.token, shift)
                group = self.batch
        except Exception as error:
            outcome.failed[handle] = error
            self._release(handle)
            self._lose_batch(error, outcome)
            return False
        row.cache, row.group = None, group
        return True

    def _lose_batch(self, error: Exception, outcome: TurnOutcome) -> None:
        """After `BatchLost` every row of the shared batch fails with it (on a sharded
        target the ranks could not agree on the rows: the worker fails)."""
        if not isinstance(error, BatchLost):
            return
        if self.group is not None:
            raise error
        for handle in list(self.batch.rows):
            outcome.failed[handle] = error
            self._release(handle)

    def _demote(self, handle: int, outcome: TurnOutcome) -> None:
        """A speculative row into the shared batch (another request joins), its target
        cache as it stands and its last token, handed out, as the next input."""
        row = self.rows[handle]
        group = row.group
        try:
            self.batch.add(handle, row.sampler, group.cache, group.token, group.shift)
        except Exception as error:
            outcome.failed[handle] = error
            self._release(handle)
            self._lose_batch(error, outcome)
            return
        row.group = self.batch

    def _agree(self, plan: TurnPlan, stored: list, joined: list, outcome: TurnOutcome) -> bool:
        """Every rank learns which stores and joins failed on any rank, and undoes
        them: a row must be in every rank's batch or in none. A store that failed
        somewhere leaves the ranks' prefix caches different: True, they are to be
        cleared (after the plan's restores; rank 0's index with them)."""
        local = np.array([not ok for ok in stored + joined], dtype=np.int32)
        anywhere = np.array(mx.distributed.all_sum(mx.array(local), group=self.group)) > 0
        clear = bool(anywhere[: len(stored)].any())
        for join, failed, ok in zip(plan.joins, anywhere[len(stored):], joined):
            if failed and ok:
                self._release(join.handle)
                outcome.failed.setdefault(join.handle, RuntimeError(
                    "joining the decode batch failed on another rank"))
        return clear

    def _decode(self, outcome: TurnOutcome) -> None:
        groups = [self.batch] if len(self.batch) else []
        groups += [g for g in dict.fromkeys(row.group for row in self.rows.values())
                   if isinstance(g, (SoloDecode, SpeculativeDecode))]
        for group in groups:
            try:
                produced, failed = group.step()
            except Exception as error:  # e.g. out of memory: these rows fail, the others go on
                if self.group is not None:
                    raise
                for handle in list(group.rows):
                    outcome.failed[handle] = error
                    self._release(handle)
                continue
            outcome.tokens += produced
            outcome.failed.update(failed)
            if isinstance(group, SpeculativeDecode):
                outcome.drafted[group.rows[0]] = group.round

    def _restore(self, restore: Restore) -> None:
        row = self._row(restore.handle)
        row.cache = _restored(self.prefix, self.model, restore)
        row.held = restore.positions

    def _chunk(self, chunk, outcome: TurnOutcome) -> None:
        started = time.perf_counter()
        row = self.rows[chunk.handle]
        cache, windows = row.cache, None
        if chunk.positions is not None:  # sliding windows by true position, across chunks
            if row.windows is None:
                row.windows = SlidingWindows(cache, row.held)
            windows = row.windows
        logits = prefill_chunk(self.model, mx.array(chunk.tokens), cache, chunk.positions,
                               want_logits=chunk.last, windows=windows)
        if self.kv is not None:  # as mlx-lm's generate_step: after each chunk
            self.kv.apply(cache)
        if chunk.checkpoint and self.checkpointed:
            row.snapshots[chunk.checkpoint] = snapshot(cache)
        outcome.seconds[chunk.handle] = (outcome.seconds.get(chunk.handle, 0.0)
                                         + time.perf_counter() - started)
        if chunk.last and self.sampling:
            self._sample_first(chunk.handle, logits[:, -1, :], outcome)

    def _sample_first(self, handle: int, logits: mx.array, outcome: TurnOutcome) -> None:
        """Sample a prompt's first token from its last chunk's logits (rank 0, which
        sends it to the other ranks in the join). A processor that fails fails its
        request; the plan that ends it releases its work on every rank."""
        sampler = self.rows[handle].sampler
        try:
            tokens, logprobs = sample_rows([sampler], logits, [_NO_TOKENS])
            mx.eval(tokens, logprobs or ())  # one sync for the token and its logprobs
        except Exception as error:
            outcome.failed[handle] = error
            return
        token = tokens.item()
        logprob = read_logprobs(logprobs, [token], [sampler.params.logprobs])[0]
        outcome.tokens.append((handle, token, logprob))

    # the draft's scoring (rank 0) ---------------------------------------------------

    def _score(self, unit, outcome: TurnOutcome) -> None:
        """One unit of a request's scoring; a failure is SpecPrefill's own (the request
        goes on densely): it comes back as the handle's importance being an error."""
        started = time.perf_counter()
        scorer, handle = self.scorer, unit.handle
        row = self._row(handle)
        try:
            if unit.restore is not None:
                cache = _restored(self.draft_prefix, scorer.model, unit.restore)
                row.scoring = _DraftWork(cache, scored_sites(scorer.model, unit.length, cache))
            work = row.scoring
            if unit.reduce:
                importance = None  # a draft that only computed the prompt's KV
                if work.queries is not None:
                    importance = np.array(importance_of(
                        scorer.model, work.sites, work.queries, work.cache, unit.length,
                        scorer.pool_kernel, scorer.n_window), dtype=np.float32)
                if unit.store is not None and self.draft_prefix is not None:
                    held = self.draft_prefix.put(unit.store, work.cache, {})
                    if held is not None:
                        outcome.draft_stored[handle] = (tuple(held.checkpoints), held.nbytes)
                        for key in () if unit.store.into else unit.store.absorbs:
                            self.draft_prefix.drop(key)
                if unit.keep_for_decode:  # the prompt's KV, its lookahead steps cut off
                    trim_prompt_cache(work.cache, cache_length(work.cache) - unit.length)
                    row.draft = work.cache
                row.scoring = None
                outcome.scored[handle] = importance
            elif unit.echoes:
                echo_question(scorer.model, mx.array(unit.tokens), work.cache, work.sites,
                              work.queries)
            elif unit.lookahead:
                work.token = lookahead_step(scorer.model, work.token, work.cache, work.sites,
                                            work.queries, scorer.temperature)
            elif unit.captures:
                work.queries, work.token = capture_window(
                    scorer.model, mx.array(unit.tokens), work.cache, work.sites,
                    min(scorer.n_window, unit.length), scorer.n_lookahead, scorer.temperature)
            else:
                prefill_chunk(scorer.model, mx.array(unit.tokens), work.cache)
        except Exception as error:
            row.scoring = None
            outcome.scored[handle] = error
        outcome.scoring_seconds[handle] = time.perf_counter() - started

    # the disk tier (rank 0: never on a sharded target) ----------------------------------

    def _persist(self, persist, outcome: TurnOutcome) -> None:
        """Hand an entry's tensors to its disk tier's writer (a file name when taken)."""
        store = self.draft_prefix if persist.draft else self.prefix
        held = store.held.get(persist.entry.key)
        name = store.disk.write(persist.entry, held) if held is not None else None
        outcome.persisted.append((persist, name))

    def _load(self, load, outcome: TurnOutcome) -> None:
        """Read an entry back from its file; None in the outcome when it cannot be read."""
        store = self.draft_prefix if load.draft else self.prefix
        held = store.disk.read(load.stub)
        if held is not None:
            store.add(load.key, held)
        outcome.loaded[load.draft, load.key] = None if held is None else held.nbytes

    def clear(self) -> None:
        self.rows.clear()
        self.batch = DecodeBatch(self.model, self.group, self.sampling)
        if self.prefix is not None:
            self.prefix.clear()
        if self.draft_prefix is not None:
            self.draft_prefix.clear()


def _restored(store: Optional[KVStore], model, restore: Restore) -> list:
    """A fresh cache for `restore`: empty, or from the store's entry it names."""
    if store is None or restore.key < 0:
        return make_prompt_cache(model)
    return store.restore(model, restore.key, restore.cut, restore.count)
