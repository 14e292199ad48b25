"""Runs a turn's plan on the target: the same code on one process and on every rank.

The executor owns what the target computes with: each prefilling request's cache and
the checkpoints taken on the way (models whose caches cannot be cut: `prefix_cache.py`),
the decode batch (and the solo decodes of a model that cannot batch) and the prefix
cache, which every rank keeps alike by making the same calls on it. It runs a
`TurnPlan` in the plan's order and returns a `TurnOutcome`: the tokens the decode step
read back, the last logits of prompts whose last chunk ran, and per-request errors.
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
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..core.prefill import prefill_chunk
from ..core.windows import SlidingWindows
from .batch import DecodeBatch, SoloDecode, cut_cache
from .plan import TurnPlan
from .prefix_cache import Hit, PrefixCache, checkpointed, snapshot

logger = logging.getLogger(__name__)


@dataclass
class TurnOutcome:
    tokens: list = field(default_factory=list)  # (row, token, TokenLogprob or None) decoded
    logits: dict = field(default_factory=dict)  # handle -> (1, vocab) last prompt logits
    failed: dict = field(default_factory=dict)  # handle -> error
    stored: dict = field(default_factory=dict)  # handle -> the prefix-cache key it is kept as
    seconds: dict = field(default_factory=dict)  # handle -> time in its prefill chunks


class _Row:
    """A rank > 0's stand-in for a request: only its handle matters."""

    __slots__ = ("handle", "processors")

    def __init__(self, handle: int):
        self.handle, self.processors = handle, []


class Executor:
    def __init__(self, model, prefix: Optional[PrefixCache], group=None, sampling: bool = True):
        self.model = model
        self.prefix = prefix
        self.group = group  # a sharded target's process group
        self.sampling = sampling  # rank 0: rows are RequestStates that sample
        self.caches: dict = {}  # handle -> target cache while prefilling
        self.checkpointed = checkpointed(model)  # snapshots at message boundaries
        self.snapshots: dict = {}  # handle -> {prefix length: Snapshot}
        self.held: dict = {}  # handle -> positions of a restored sparse prefix's entries
        self.windows: dict = {}  # handle -> SlidingWindows of its sparse prefill
        self.rows: dict = {}  # handle -> row while decoding
        self.groups: dict = {}  # handle -> its DecodeBatch or SoloDecode
        self.batch = DecodeBatch(model, group, sampling)
        # fault injection for tests: stage -> predicate(handle) raising inside that stage
        self.faults: dict = {}

    def _fault(self, stage: str, handle: int) -> None:
        check = self.faults.get(stage)
        if check is not None:
            check(handle)

    def run(self, plan: TurnPlan, rows: Optional[Callable[[int], object]] = None) -> TurnOutcome:
        """Run one plan; `rows(handle)` gives rank 0's request state for a join."""
        outcome = TurnOutcome()
        if self.prefix is not None:
            self.prefix.merged.clear()  # a plan's restores name entries as it was decided
        stored = [self._store(s, outcome) for s in plan.stores]
        clear = False
        for key in plan.drops:
            self.prefix.drop(key)
        for handle in plan.releases:
            self._release(handle)
        joined = [self._join(j, rows, outcome) for j in plan.joins]
        if self.group is not None and (plan.stores or plan.joins):
            clear = self._agree(plan, stored, joined, outcome)
        if plan.decode:
            self._decode(outcome)
        for entry in plan.restores:
            self._guard(outcome, entry.handle, "restore", self._restore, entry)
        for chunk in plan.chunks:
            if chunk.handle not in outcome.failed:
                self._guard(outcome, chunk.handle, "prefill", self._chunk, chunk, outcome)
        if clear:  # after this plan's restores, which name entries every rank holds
            self.prefix.clear()
        return outcome

    def _guard(self, outcome: TurnOutcome, handle: int, stage: str, work, *args) -> None:
        try:
            self._fault(stage, handle)
            work(*args)
        except Exception as error:
            if self.group is not None:
                raise  # the other ranks run this request's forwards: they cannot agree now
            outcome.failed[handle] = error
            self._release(handle)

    # target work ----------------------------------------------------------------

    def _store(self, store, outcome: TurnOutcome) -> bool:
        """Keep a request's cache for its next turn; a failure (a copy that cannot be
        allocated) only leaves it out."""
        handle = store.handle
        count = store.tokens.size if store.positions is None else store.positions.size
        try:
            self._fault("store", handle)
            if handle in self.caches:
                cache = self.caches[handle]
                cache = cache if self.checkpointed else cut_cache(cache, count)
            else:
                cache = self.groups[handle].extract(self.rows[handle], count)
            checkpoints = {length: snap for length, snap in self.snapshots.get(handle, {}).items()
                           if length <= store.tokens.size}
            key = self.prefix.store(store.tokens, cache, store.positions, checkpoints, store.keep,
                                    store.densified)
            if key is not None:
                outcome.stored[handle] = key
            return True
        except Exception as error:
            logger.warning("prefix-cache store of request #%d failed: %r", handle, error)
            return False

    def _release(self, handle: int) -> None:
        for table in (self.caches, self.snapshots, self.held, self.windows):
            table.pop(handle, None)
        row = self.rows.pop(handle, None)
        group = self.groups.pop(handle, None)
        if group is not None:
            group.remove({row})

    def _join(self, join, rows, outcome: TurnOutcome) -> bool:
        handle = join.handle
        row = rows(handle) if rows is not None else _Row(handle)
        try:
            self._fault("join", handle)
            cache = self.caches[handle]
            if join.solo:
                group = SoloDecode(self.model, row, cache, join.token, join.shift, self.group,
                                   self.sampling)
            else:
                self.batch.add(row, cache, join.token, join.shift)
                group = self.batch
        except Exception as error:
            outcome.failed[handle] = error
            self._release(handle)
            return False
        del self.caches[handle]
        self.rows[handle], self.groups[handle] = row, group
        return True

    def _agree(self, plan: TurnPlan, stored: list, joined: list, outcome: TurnOutcome) -> bool:
        """Every rank learns which stores and joins failed on any rank, and undoes
        them: a row must be in every rank's batch or in none. A store that failed
        somewhere leaves the ranks' prefix caches different: True, they are to be
        cleared (after the plan's restores), and the next key is agreed (a rank that
        stored used one, a rank that failed did not)."""
        local = np.array([not ok for ok in stored + joined], dtype=np.int32)
        anywhere = np.array(mx.distributed.all_sum(mx.array(local), group=self.group)) > 0
        clear = bool(anywhere[: len(stored)].any())
        if clear:
            agreed = mx.distributed.all_max(mx.array([self.prefix.next_key]), group=self.group)
            self.prefix.next_key = int(agreed.item())
        for join, failed, ok in zip(plan.joins, anywhere[len(stored):], joined):
            if failed and ok:
                self._release(join.handle)
                outcome.failed.setdefault(join.handle, RuntimeError(
                    "joining the decode batch failed on another rank"))
        return clear

    def _decode(self, outcome: TurnOutcome) -> None:
        check = self.faults.get("decode")
        if check is not None:  # a row whose step cannot be prepared leaves before it
            for handle in list(self.rows):
                try:
                    check(handle)
                except Exception as error:
                    outcome.failed[handle] = error
                    self._release(handle)
        groups = [self.batch] if len(self.batch) else []
        groups += [g for g in dict.fromkeys(self.groups.values()) if isinstance(g, SoloDecode)]
        for group in groups:
            try:
                produced, failed = group.step()
            except Exception as error:  # e.g. out of memory: these rows fail, the others go on
                if self.group is not None:
                    raise
                for row in list(group.rows):
                    outcome.failed[row.handle] = error
                    self._release(row.handle)
                continue
            outcome.tokens += produced
            for row, error in failed.items():
                outcome.failed[row.handle] = error

    def _restore(self, restore) -> None:
        hit = None
        if restore.key >= 0:
            key = self.prefix.resolve(restore.key)
            hit = Hit(self.prefix.entries[key], restore.cut, restore.cut)
            self.prefix.touch(key)
        self.caches[restore.handle], held = PrefixCache.restore(self.model, hit, restore.cut)
        if held is not None:
            self.held[restore.handle] = held

    def _chunk(self, chunk, outcome: TurnOutcome) -> None:
        started = time.perf_counter()
        cache = self.caches[chunk.handle]
        windows = None
        if chunk.positions is not None:  # sliding windows by true position, across chunks
            windows = self.windows.get(chunk.handle)
            if windows is None:
                windows = self.windows[chunk.handle] = SlidingWindows(
                    cache, self.held.get(chunk.handle))
        logits = prefill_chunk(self.model, mx.array(chunk.tokens), cache, chunk.positions,
                               want_logits=chunk.last, windows=windows)
        if chunk.checkpoint and self.checkpointed:
            self.snapshots.setdefault(chunk.handle, {})[chunk.checkpoint] = snapshot(cache)
        seconds = outcome.seconds.get(chunk.handle, 0.0) + time.perf_counter() - started
        outcome.seconds[chunk.handle] = seconds
        if chunk.last:
            outcome.logits[chunk.handle] = logits[:, -1, :]

    def cache_of(self, handle: int) -> list:
        """A prefilled request's cache (rank 0 reads the first attention layer's length)."""
        return self.caches[handle]

    def clear(self) -> None:
        for table in (self.caches, self.snapshots, self.held, self.windows):
            table.clear()
        self.rows.clear()
        self.groups.clear()
        self.batch = DecodeBatch(self.model, self.group, self.sampling)
        if self.prefix is not None:
            self.prefix.clear()
