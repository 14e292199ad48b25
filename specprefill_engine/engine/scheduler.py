"""The scheduler: one owner of every request's progress, with vLLM's contract.

It keeps the table of requests (by handle, each with its `Status`), and is the only
code that changes a status; it admits requests within `max_batch_size` and the KV
budget (`memory.py`), queues the densify jobs and the disk writes, and keeps the prefix
caches' indexes. The worker's loop (`worker.py`) asks it for a turn's plan
(`schedule`), has the executor run the plan, and hands it the outcome (`update`):

- `schedule()` -> `TurnPlan`: the stores and releases of requests that ended, the joins
  of requests whose first token is out, one decode step, and one unit of prefill work
  for the oldest admitted request (first come, first served: later arrivals never
  stretch an earlier TTFT), a unit of its draft's scoring while it is scored, plus a
  last chunk costing at most a quarter of a unit. A turn that starts with a whole short
  prompt (surely dense, one chunk) goes on with the short prompts next in line, up to
  one unit's cost and four prompts, each in its own forward (its KV is what it would be
  alone), so requests arriving together start decoding together. Then a densify unit
  when nothing else runs, and the prefix caches' evictions.
- `update(plan, outcome)`: the indexes take what was stored and read, tokens go to the
  callers (a prompt's first token too), a finished scoring's importance to the
  selection (`planner.py`, whose functions decide a request's prefill in its fields and
  leave its status to the scheduler), each failure to its own request.

So a decoding stream waits at most about one prefill unit between two tokens. Every
request ends with a Result or an error, whatever happens, by one path (`_end`, its
reason as data): a failure in any of a request's steps ends that request alone. Densify
jobs are the engine's own work, not requests: no caller waits on them, so they queue
apart and end by being dropped. It runs on the worker's thread; callers reach the table
only through `add`, `find` and `active_ids`, under its lock.
"""

import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from . import densify
from .delivery import one_delivery
from .executor import TurnOutcome
from .memory import MemoryBudgetError, MemoryStats, Reservation, need_message, reservation
from .plan import Join, Store, TurnPlan
from .planner import (
    after_draft_feed, begin, caches_for, fall_back_to_dense, plan_sparse, promote,
    short_prefill_share, speculation, take_scoring_units,
)
from .prefix_cache import PrefixIndex, PrefixIndexes
from .results import Progress
from .runtime import Runtime
from .state import RequestState, Status

logger = logging.getLogger(__name__)
SHORT_PREFILL_FLOOR = 0.25  # the least share of a turn's unit a packed short prefill counts
# with densify="decode", the statuses a densify unit may share a turn with (none of them
# waits for a prefill); otherwise a unit runs only when every request has ended
BESIDE_DECODE = (Status.DECODING, Status.JOINING, Status.LEAVING, Status.ENDED)


class EngineFailedError(RuntimeError):
    """The engine's worker thread failed; the message carries the cause."""


class RequestFailedError(RuntimeError):
    """One request failed on the worker (the cause is chained); the engine goes on."""


def _same_start(tokens: np.ndarray, stored: np.ndarray, length: int = 64) -> bool:
    """Whether a prompt may continue a stored sequence (an agent's next turn)."""
    n = min(length, tokens.size, stored.size)
    return n > 0 and np.array_equal(tokens[:n], stored[:n])


# the statuses of an admitted request that decodes, or will, in the shared batch
BATCH_BOUND = (Status.SCORING, Status.PREFILLING, Status.LAST_CHUNK, Status.JOINING,
               Status.DECODING)


def _admitted(live: list) -> int:
    """Requests admitted and not ended: each is, or will be once prefilled, a batch row."""
    return sum(s.status not in (Status.WAITING, Status.LEAVING, Status.ENDED) for s in live)


def _started(state: RequestState) -> Status:
    """The status of a request whose prefill the planner has decided: its draft scores
    it (or feeds it, to propose the reply) first, or the target prefills it."""
    return Status.SCORING if state.scoring is not None else Status.PREFILLING


class Scheduler:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[int, RequestState] = {}  # the table, by handle, under the lock
        self._handles = itertools.count(1)
        self.runtime: Optional[Runtime] = None  # set by `start`, on the worker's thread
        self.indexes: Optional[PrefixIndexes] = None
        self._register: Optional[Callable] = None  # the executor's, for an admitted sampler
        self._jobs: deque = deque()  # SpecPrefill turns to densify while idle
        self._persists: list = []  # Persist ops for the next plan
        self.densify_stats = densify.DensifyStats()
        self._reserved = 0  # bytes every admitted request's `Reservation` adds up to
        self.memory_stats: Optional[MemoryStats] = None  # a new one each turn (`stats()`)
        self._evicted = 0  # prefix-cache entries dropped to make room for requests
        self._shares: dict = {}  # handle -> (prefix cache version, `_short_share`)

    def start(self, runtime: Optional[Runtime], caches: Optional[PrefixIndexes],
              register: Optional[Callable]) -> None:
        """The models are loaded: `caches` are the prefix caches' indexes, `register`
        gives the executor an admitted request's sampler (all None at shutdown)."""
        self.runtime, self.indexes, self._register = runtime, caches, register
        if runtime is not None:
            self._count_memory(runtime, caches)

    # the table (callers' threads, under the lock) ------------------------------------

    def add(self, state: RequestState) -> None:
        """A new request (hold the lock): it gets its handle and waits."""
        if any(s.id == state.id for s in self.active()):
            raise ValueError(f"request_id {state.id!r} is already in flight")
        state.handle = next(self._handles)
        self.requests[state.handle] = state

    def active(self) -> list:
        """The requests submitted and not yet finished (hold the lock)."""
        return [s for s in self.requests.values() if not s.finished]

    def active_ids(self) -> list:
        with self.lock:
            return [state.id for state in self.active()]

    def find(self, request_id: str) -> Optional[RequestState]:
        """An unfinished request by its id."""
        with self.lock:
            return next((s for s in self.active() if s.id == request_id), None)

    # the contract ------------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing to do until a request comes."""
        return not any(s.status is not Status.ENDED for s in self._live()) and not (
            self._jobs or self._persists)

    def schedule(self) -> TurnPlan:
        """The next turn's plan (empty when there is nothing to run)."""
        runtime, caches = self.runtime, self.indexes
        live = self._live()
        self._end_aborted(live)
        plan = TurnPlan(persists=self._persists)
        self._persists = []
        self._plan_endings(plan, live, caches.target)
        self._plan_joins(plan, live, runtime, caches.target)
        plan.decode = any(s.status is Status.DECODING for s in live)
        self._plan_prefill(plan, runtime, caches)
        live = self._live()
        if caches.target is not None:
            self._plan_densify(plan, live, runtime, caches.target)
            for restore in plan.restores:
                caches.target.touch(restore.key)
        self._plan_evictions(plan, live, runtime, caches)
        self._spill(plan, caches)
        return plan

    def update(self, plan: TurnPlan, outcome: Optional[TurnOutcome]) -> None:
        """What the plan did (`outcome`; None: nothing ran)."""
        if outcome is not None:
            self._commit(plan, outcome, self.indexes)
            self._absorb(plan, outcome, self.runtime, self.indexes)
            self._densified(plan, outcome)
        self._count_memory(self.runtime, self.indexes)

    def closing(self, run: Callable[[TurnPlan], TurnOutcome]) -> None:
        """At shutdown: the stores of requests that ended after the last plan (their
        results are out, their caches not kept yet), then every write still queued, so
        the disk tier has every turn (`run`: the executor's)."""
        plan = TurnPlan()
        self._plan_endings(plan, self._live(), self.indexes.target)
        for _ in range(2):
            plan.persists, self._persists = self._persists, []
            if not plan:
                return
            try:
                outcome = run(plan)
            except Exception as error:  # shutting down: the turn is only not kept
                logger.warning("keeping the last turns at shutdown failed: %r", error)
                return
            self._commit(plan, outcome, self.indexes)
            plan = TurnPlan()

    def abort_all(self) -> None:
        """At shutdown: every request still running or queued ends with "abort"."""
        for state in self._live():
            self._end(state, "abort")
        self._jobs.clear()
        with self.lock:
            self.requests.clear()

    def fail_all(self, failed: EngineFailedError) -> None:
        """The loop cannot go on: every live request gets `failed`, without `_end`'s
        bookkeeping (no plan will run again to store or release anything)."""
        with self.lock:
            live = self.active()
        for state in live:
            self._deliver(state, None, failed)

    # the table, on the worker ----------------------------------------------------

    def _live(self) -> list:
        """The table now, in submission order."""
        with self.lock:
            return list(self.requests.values())

    @staticmethod
    def _head(live: list) -> Optional[RequestState]:
        """The admitted request being scored or prefilled (one at a time)."""
        return next((s for s in live if s.status in (Status.SCORING, Status.PREFILLING)), None)

    def _end_aborted(self, live: list) -> None:
        for state in live:
            if state.cancelled.is_set() and not state.finished:
                self._end(state, "abort")

    def _forget(self, state: RequestState) -> None:
        state.status = Status.ENDED
        self._shares.pop(state.handle, None)
        with self.lock:
            self.requests.pop(state.handle, None)

    # planning ----------------------------------------------------------------------

    def _plan_endings(self, plan: TurnPlan, live: list, target: Optional[PrefixIndex]) -> None:
        """Requests that ended: their cache kept for an agent's next turn (prompt and
        reply), then their target work released and they leave the table."""
        for state in live:
            if state.status is not Status.LEAVING:
                continue
            if state.stored_reply is not None and target is not None:
                store = self._plan_store(plan, state, state.stored_reply, target, live)
                if state.positions is not None and self.runtime.config.densify != "off":
                    self._add_job(store.tokens, store.key, int(state.tokens.size))
            plan.releases.append(state.handle)
            self._forget(state)

    def _plan_store(self, plan: TurnPlan, state: RequestState, replied: int,
                    target: PrefixIndex, live: list) -> Store:
        """Keep the request's cache: its prompt and the first `replied` tokens of its reply."""
        tokens = np.concatenate([state.tokens, np.asarray(state.generated[:replied], np.int32)])
        positions = state.positions
        if positions is not None:
            positions = np.concatenate([positions, state.tokens.size + np.arange(replied)])
        keep = state.keep if state.positions is not None else 1.0
        store = Store(state.handle, tokens, positions, keep, densified=state.densified,
                      prompt=int(state.tokens.size))
        target.plan_store(store, self._pinned(live))
        plan.stores.append(store)
        return store

    def _plan_joins(self, plan: TurnPlan, live: list, runtime: Runtime,
                    target: Optional[PrefixIndex]) -> None:
        """Requests whose first token is out join the decode. One that joins alone, with
        nothing else decoding, decodes speculatively if it was to; a speculative row
        another request joins moves into the shared batch."""
        joining = [s for s in live if s.status is Status.JOINING]
        decoding = [s for s in live if s.status is Status.DECODING]
        alone = len(joining) == 1 and not decoding
        for state in joining:
            if state.cache_prompt and target is not None and state.positions is None:
                self._plan_store(plan, state, 0, target, live)  # the prompt's KV
            if state.speculative and not alone:
                state.speculative = False
                state.report.speculative = "off: another request was starting to decode"
            plan.joins.append(Join(state.handle, state.generated[0], int(state.tokens.size),
                                   solo=bool(runtime.batch_reason),
                                   speculative=state.num_draft_tokens if state.speculative else 0))
        if joining and not runtime.batch_reason:
            for state in decoding:
                if state.speculative:
                    plan.demotions.append(state.handle)
                    state.speculative = False
                    state.report.speculative += "; then in the shared batch, another request joined"
                    state.batched = state.report.batched = True
                    state.report.batch_reason = "decoding in the shared batch"

    def _plan_prefill(self, plan: TurnPlan, runtime: Runtime, caches: PrefixIndexes) -> None:
        """One unit of the oldest prefill, or of its draft's scoring. A turn that starts
        with a whole short prompt goes on with the short prompts next in line while the
        unit's cost is not spent; each counts at least `SHORT_PREFILL_FLOOR` of it (a
        forward, its sync and the first token cost host time whatever the length), so at
        most four share a turn."""
        spent = 0.0  # share of the unit
        while True:
            live = self._live()
            state, share = self._head(live), None
            if state is None:
                waiting = next((s for s in live if s.status is Status.WAITING), None)
                if waiting is None or waiting.cancelled.is_set():
                    return  # a cancelled request ends at the next turn's start
                if any(_same_start(waiting.tokens, store.tokens) for store in plan.stores):
                    return  # admitted next turn, where its lookup finds what this plan stores
                share = self._short_share(waiting, runtime, caches)
                if spent and (share is None or spent + share > 1 + 1e-9):
                    return  # it waits for a turn of its own
                if not self._admit(waiting, live, runtime, caches, plan):
                    return
                if waiting.finished:
                    continue  # it failed at admission
                state = waiting
            if state.status is Status.SCORING:
                plan.scoring += take_scoring_units(state, caches_for(state, caches).draft)
                self._plan_short_prefills(plan, runtime, caches)
                return
            state.prefill.add_unit(plan, int(state.tokens.size))
            if state.prefill.done:
                state.status = Status.LAST_CHUNK
            if not state.prefill.done or share is None:
                self._plan_short_prefills(plan, runtime, caches)
                return  # a prefill spanning units spends the whole turn, short ones beside
            spent += share

    def _plan_short_prefills(self, plan: TurnPlan, runtime: Runtime,
                             caches: PrefixIndexes) -> None:
        """Beside a unit of a long prefill, the waiting requests whose whole prefill is
        short (a cached session's next turn), in line order, up to one unit's cost: a
        long prefill no longer holds back every request behind it, and its own turns
        grow by at most that much."""
        spent, ahead = 0.0, None  # the oldest long request waiting: its place is kept
        for state in self._live():
            if state.status is not Status.WAITING or state.cancelled.is_set():
                continue
            share = self._short_share(state, runtime, caches)
            if share is None:
                ahead = ahead or state
                continue
            if spent + share > 1 + 1e-9:
                return
            if any(_same_start(state.tokens, store.tokens) for store in plan.stores):
                continue
            live = self._live()
            if ahead is not None and not self._room_for_both(ahead, state, live, runtime,
                                                             caches, plan):
                return  # it would take the memory or batch row the older one waits for
            if not self._admit(state, live, runtime, caches, plan) or state.finished:
                continue
            spent += share
            if state.status is Status.PREFILLING:
                state.prefill.add_unit(plan, int(state.tokens.size))
                if state.prefill.done:
                    state.status = Status.LAST_CHUNK

    def _room_for_both(self, older: RequestState, short: RequestState, live: list,
                       runtime: Runtime, caches: PrefixIndexes, plan: TurnPlan) -> bool:
        """Whether `short` can be admitted ahead of `older` and leave it a batch row and
        its memory: a short prefill goes first only where it delays no one."""
        return _admitted(live) + 2 <= runtime.config.max_batch_size and self._fits(
            live, runtime, caches, plan, self._reservation(older, runtime),
            self._reservation(short, runtime))

    def _short_share(self, state: RequestState, runtime: Runtime,
                     caches: PrefixIndexes) -> Optional[float]:
        """`short_prefill_share` (at least `SHORT_PREFILL_FLOOR`), again only once the
        target's prefix cache has changed."""
        version = caches.target.next_key if caches.target is not None else 0
        known = self._shares.get(state.handle)
        if known is None or known[0] != version:
            share = short_prefill_share(state, runtime, caches)
            known = self._shares[state.handle] = (
                version, None if share is None else max(share, SHORT_PREFILL_FLOOR))
        return known[1]

    def _admit(self, state: RequestState, live: list, runtime: Runtime,
               caches: PrefixIndexes, plan: TurnPlan) -> bool:
        """Start the oldest waiting request's prefill, if the batch and KV budget allow,
        after reading back what the disk tier holds for it (a turn of its own)."""
        if _admitted(live) >= runtime.config.max_batch_size:
            return False
        need = self._reservation(state, runtime)
        if need.total > runtime.memory.budget:  # `Engine._prepare` refuses it first
            self._end(state, error=MemoryBudgetError(need_message(
                need, runtime.memory, f"{state.tokens.size} prompt tokens + max_tokens "
                f"{state.max_tokens}")))
            return True
        if not self._fits(live, runtime, caches, plan, need):
            return False  # it waits for running requests to end; the caches give back
        if not state.promoted:
            state.promoted = True
            loads = promote(state, runtime, caches)
            if loads:
                plan.loads += loads
                return False  # admitted next turn, where its lookup finds what is read
        self._reserve(state, need)
        try:
            sampler = state.start()
            others = any(s is not state and s.status is not Status.WAITING and not s.finished
                         for s in live)
            state.speculative, state.report.speculative = speculation(state, runtime, sampler,
                                                                      others)
            begin(state, runtime, caches)
            state.status = _started(state)
            self._reserve(state, self._reservation(state, runtime,
                                                   state.status is Status.SCORING))
        except Exception as error:
            self._end(state, error=error)
            return True
        self._register(state.handle, sampler)
        return True

    # densify -----------------------------------------------------------------------

    def _add_job(self, tokens: np.ndarray, replaces: int, prompt: int) -> None:
        """A SpecPrefill turn to densify (its sparse entry's key: `replaces`), first in
        line unless a job is under way: the newest turn is the one an agent's next turn
        extends. Queued turns it extends are not needed."""
        jobs = [job for job in self._jobs if job.feed is not None or not (
            job.tokens.size <= tokens.size and np.array_equal(job.tokens, tokens[: job.tokens.size]))]
        job = densify.Job(next(self._handles), tokens, replaces, prompt)
        at = 1 if jobs and jobs[0].feed is not None else 0
        self._jobs = deque(jobs[:at] + [job] + jobs[at:])

    def _plan_densify(self, plan: TurnPlan, live: list, runtime: Runtime,
                      target: PrefixIndex) -> None:
        """Keep what the current job computed; give it a unit when nothing else runs
        (with densify="decode", also beside a decode step)."""
        if not self._jobs:
            return
        job = self._jobs[0]
        if job.failed:  # given up, not retried
            plan.releases.append(job.handle)
            self._jobs.popleft()
            return
        store = densify.store(job)
        if store is not None:
            target.plan_store(store, self._pinned(live))
            plan.stores.append(store)
        if job.feed is not None and job.feed.done:  # done: the dense KV replaces
            if job.replaces is not None:  # the sparse entry
                plan.drops.append(job.replaces)
            plan.releases.append(job.handle)
            self._jobs.popleft()
            self.densify_stats.entries += 1
            return
        quiet = BESIDE_DECODE if runtime.config.densify == "decode" else (Status.ENDED,)
        if plan.chunks or any(s.status not in quiet for s in live):
            return
        if job.feed is None and not densify.start(job, runtime.model, target,
                                                  runtime.config.step_size):
            self._jobs.popleft()  # a dense prefix covers it already
            return
        job.feed.add_unit(plan)
        if plan.decode:
            self.densify_stats.decode_units += 1

    def _densified(self, plan: TurnPlan, outcome: TurnOutcome) -> None:
        """The densify units' work."""
        stats = self.densify_stats
        for chunk in plan.chunks:
            if self._jobs and chunk.handle == self._jobs[0].handle:
                stats.tokens += int(chunk.tokens.size)
        if self._jobs:
            job = self._jobs[0]
            stats.seconds += outcome.seconds.get(job.handle, 0.0)
            job.failed = job.handle in outcome.failed
        stats.pending = len(self._jobs)

    # memory and the prefix caches ----------------------------------------------------

    def _plan_evictions(self, plan: TurnPlan, live: list, runtime: Runtime,
                        caches: PrefixIndexes) -> None:
        """Each prefix cache within its own budget and, together, within what the
        running requests' reservations leave of the memory budget: the target's least
        recently used entries go first, then the draft's."""
        room = runtime.memory.budget - self._reserved - self._padding(live, runtime)
        target, draft = caches.target, caches.draft
        draft_bytes = draft.total_bytes if draft is not None else 0
        if target is not None:
            pinned = {r.key for r in plan.restores} | self._pinned(live)
            own = target.evictions(pinned)
            drops = target.evictions(pinned, room - draft_bytes)
            self._evicted += len(drops) - len(own)
            plan.drops += drops
            room -= target.total_bytes - sum(target.entries[k].nbytes for k in drops)
        if draft is not None:
            pinned = {u.restore.key for u in plan.scoring if u.restore is not None}
            own = draft.evictions(pinned)
            plan.draft_drops = draft.evictions(pinned, room)
            self._evicted += len(plan.draft_drops) - len(own)

    def _reservation(self, state: RequestState, runtime: Runtime,
                     scored: Optional[bool] = None) -> Reservation:
        """What `state` may come to hold: its target KV for the prompt (its kept entries
        once selected) and max_tokens, and the draft's of the prompt while it may be
        scored (`scored` None: not known yet) or proposes the reply."""
        prompt = int(state.tokens.size)
        entries = prompt if state.positions is None else int(state.positions.size)
        proposes = state.speculative
        if scored is None:  # before admission: whatever the draft may do
            scored = runtime.scorer is not None and state.specprefill is not False
            proposes = runtime.scorer is not None and state.num_draft_tokens > 0
        return reservation(runtime.rates, prompt, entries, state.max_tokens, scored, proposes)

    def _reserve(self, state: RequestState, reservation: Reservation) -> None:
        self._reserved += reservation.total - state.reserved.total
        state.reserved = reservation

    def _fits(self, live: list, runtime: Runtime, caches: PrefixIndexes, plan: TurnPlan,
              *needs: Reservation) -> bool:
        """Whether `needs` fit beside the running requests once the prefix caches give
        back every entry no planned restore names."""
        pinned = {r.key for r in plan.restores} | self._pinned(live)
        kept = caches.target.pinned_bytes(pinned) if caches.target is not None else 0
        padding = self._padding(live, runtime, *(need.target for need in needs))
        return self._reserved + kept + sum(need.total for need in needs) + padding \
            <= runtime.memory.budget

    def _padding(self, live: list, runtime: Runtime, *joining: int) -> int:
        """Bytes the shared decode batch will hold beyond its rows' own KV: mlx-lm's batch
        caches pad every row to the longest. Its rows: every admitted request (one
        decoding alone with its draft joins the batch when another does), each at its
        reservation, and one per `joining` target bytes."""
        if runtime.batch_reason:
            return 0
        rows = [s.reserved.target for s in live if s.status in BATCH_BOUND]
        rows += [row for row in joining if row]
        return len(rows) * max(rows) - sum(rows) if len(rows) > 1 else 0

    def _count_memory(self, runtime: Runtime, caches: PrefixIndexes) -> None:
        """`stats()["memory"]`, a new object each turn (read from other threads)."""
        budget = runtime.memory
        target = caches.target.total_bytes if caches.target is not None else 0
        draft = caches.draft.total_bytes if caches.draft is not None else 0
        live = self._live()
        requests = {s.id: {"target": s.reserved.target, "draft": s.reserved.draft}
                    for s in live if s.reserved.total}
        padding = self._padding(live, runtime)
        self.memory_stats = MemoryStats(budget.budget, budget.source, budget.device_bytes,
                                        budget.weights_bytes,
                                        self._reserved + padding + target + draft, requests,
                                        target, draft, self._evicted, padding)

    def _report_memory(self, state: RequestState, runtime: Runtime) -> None:
        """The KV the request holds at its end, in its report (`kv_bytes`)."""
        if state.prefill is None:
            return
        rates, report = runtime.rates, state.report
        replied = self._fed(state)
        entries = int(state.tokens.size if state.positions is None else state.positions.size)
        report.kv_bytes = rates.target_bytes(entries + replied)
        report.dense_kv_bytes = rates.target_bytes(int(state.tokens.size) + replied)
        scored = state.scoring_busy > 0 or state.usage.draft_cached_tokens > 0
        if scored or state.speculative or report.drafted_tokens:
            report.draft_kv_bytes = rates.draft_bytes(
                int(state.tokens.size) + (replied if report.drafted_tokens else 0))

    @staticmethod
    def _pinned(live: list) -> set:
        """Prefix-cache keys a planned restore that has not run yet names: a store must
        not absorb them, an eviction not drop them."""
        return {s.prefill.restore.key for s in live
                if s.prefill is not None and s.prefill.fed == 0 and s.prefill.restore.key >= 0}

    @staticmethod
    def _spill(plan: TurnPlan, caches: PrefixIndexes) -> None:
        """Entries about to be evicted go to the disk tier, if there is one."""
        for cache, keys, draft in ((caches.target, plan.drops, False),
                                   (caches.draft, plan.draft_drops, True)):
            for key in keys if cache is not None else ():
                persist = cache.persist(key)
                if persist is not None:
                    persist.draft = draft
                    plan.persists.append(persist)

    def _commit(self, plan: TurnPlan, outcome: TurnOutcome, caches: PrefixIndexes) -> None:
        """The indexes take what the plan's disk reads, stores and drops did, and queue
        for the next plan the writes worth keeping on disk: a store whose work is released
        in the same plan is its last (a turn's prompt and reply, a finished densify), and
        the draft's prompt KV, stored once a scoring is done."""
        target, draft = caches.target, caches.draft
        for persist, name in outcome.persisted:
            PrefixIndex.persisted(persist, name)
        for (is_draft, key), nbytes in outcome.loaded.items():
            (draft if is_draft else target).loaded(key, nbytes)
        if target is not None:
            if outcome.cleared:
                target.clear()
            for store in plan.stores if not outcome.cleared else ():
                target.commit(store, *outcome.stored.get(store.handle, (None,)))
            for key in plan.drops:
                target.drop(key)
            released = set(plan.releases)
            for store in plan.stores:
                if store.handle in released:
                    self._persist_later(target, store.key, False)
        for unit in plan.scoring:
            if unit.store is not None:
                draft.commit(unit.store, *outcome.draft_stored.get(unit.handle, (None,)))
                self._persist_later(draft, unit.store.key, True)
        for key in plan.draft_drops:
            draft.drop(key)

    def _persist_later(self, cache: PrefixIndex, key: int, draft: bool) -> None:
        persist = cache.persist(key)
        if persist is not None:
            persist.draft = draft
            self._persists.append(persist)

    # outcomes ----------------------------------------------------------------------

    def _absorb(self, plan: TurnPlan, outcome: TurnOutcome, runtime: Runtime,
                caches: PrefixIndexes) -> None:
        table = {s.handle: s for s in self._live()}
        failed = outcome.failed
        for handle, error in failed.items():
            state = table.get(handle)
            if state is not None:
                self._end(state, error=error)
        for join in plan.joins:
            state = table.get(join.handle)
            if state is not None and not state.finished:
                state.status = Status.DECODING
                state.batched = not (runtime.batch_reason or join.speculative)
                state.report.batched = state.batched
                state.report.batch_reason = runtime.batch_reason or (
                    "decoding alone, its draft proposing tokens" if join.speculative
                    else "decoding in the shared batch")
        for handle, (proposed, taken) in outcome.drafted.items():
            state = table.get(handle)
            if state is not None:
                state.report.drafted_tokens += proposed
                state.report.accepted_tokens += taken
        # a speculative row's round gives several tokens: none is taken after the one
        # that ends its request (`ended`: handle -> (state, reason))
        firsts, ended = [], {}
        with one_delivery():  # the step's tokens reach each caller loop in one hand-over
            for handle, token, logprob in outcome.tokens:
                state = table.get(handle)
                if state is None or state.finished or handle in ended:
                    continue
                if state.status is Status.LAST_CHUNK:
                    firsts.append((state, token, logprob))
                    continue
                reason = self._accept(state, token, logprob)
                if reason is not None:
                    ended[handle] = (state, reason)
        for state, reason in ended.values():
            self._end(state, reason)
        for handle in dict.fromkeys(chunk.handle for chunk in plan.chunks):
            state = table.get(handle)
            if state is None or state.finished:
                continue
            state.prefill_busy += outcome.seconds.get(handle, 0.0)
            if state.progress:
                state.emit(Progress("prefill", state.prefill.fed, int(state.prefill.tokens.size)))
        for state, token, logprob in firsts:
            self._first_token(state, token, logprob, runtime)
        for handle, seconds in outcome.scoring_seconds.items():
            state = table.get(handle)
            if state is not None and not state.finished and state.scoring is not None:
                self._scored(state, seconds, handle in outcome.scored,
                             outcome.scored.get(handle), runtime, caches)

    @staticmethod
    def _fed(state: RequestState) -> int:
        """Generated tokens whose KV is in the request's cache: a batched row has fed
        every token read back; a solo row samples one ahead."""
        if state.status is not Status.DECODING:
            return 0
        return len(state.generated) - (0 if state.batched else 1)

    def _accept(self, state: RequestState, token: int, logprob) -> Optional[str]:
        """A sampled token to the request's output: its finish reason when it is done. A
        failure there ends the request (it is `finished` after)."""
        state.generated.append(token)
        try:
            return state.output.accept(token, logprob)
        except Exception as error:
            self._end(state, error=error)
            return None

    def _first_token(self, state: RequestState, token: int, logprob, runtime: Runtime) -> None:
        """A prompt's first token out; the request joins a decode in the next plan."""
        state.timings.prefill = time.perf_counter() - state.started - state.timings.scoring
        reason = self._accept(state, token, logprob)
        if state.finished:
            return
        feed = state.prefill
        runtime.costs.observe("repair" if state.repaired else "target", int(feed.tokens.size),
                              feed.cached, state.prefill_busy)
        busy = state.prefill_busy + state.scoring_busy
        if state.follows:
            runtime.costs.observe_followup(int(state.tokens.size) - state.follows, state.follows,
                                           busy)
        if state.cache_prompt and state.tokens.size >= state.threshold:  # a turn the policy weighs
            runtime.costs.observe_turn(int(state.tokens.size), state.continues, busy)
        if reason is not None:
            self._end(state, reason)
            return
        state.status = Status.JOINING

    def _scored(self, state: RequestState, seconds: float, done: bool, result,
                runtime: Runtime, caches: PrefixIndexes) -> None:
        """A unit of the draft's scoring ran; at its end (`done`; `result`: the
        importance, None when the draft only computed the prompt's KV, or SpecPrefill's
        own failure, after which the request goes on densely) the selection, or the
        dense prefill."""
        scoring = state.scoring
        scoring.busy += seconds
        if state.progress:  # with nothing to capture the draft only prefills (for speculation)
            phase = "scoring" if scoring.capture.size else "draft prefill"
            state.emit(Progress(phase, scoring.tokens_done(), int(state.tokens.size)))
        if not done:
            return
        caches = caches_for(state, caches)
        state.timings.scoring = time.perf_counter() - state.started
        state.scoring_busy = scoring.busy
        state.scoring = None
        if result is None:
            after_draft_feed(state, runtime, caches)
        else:
            try:
                if isinstance(result, Exception):
                    raise result
                cached = state.usage.draft_cached_tokens
                runtime.costs.observe("draft", int(state.tokens.size) - cached, cached,
                                      scoring.busy)
                plan_sparse(state, runtime, caches, result)
            except Exception as error:  # SpecPrefill's own step: the request goes on densely
                fall_back_to_dense(state, runtime, caches, error)
        state.status = _started(state)
        # the draft's KV goes (unless it proposes the reply); a sparse view holds less
        self._reserve(state, self._reservation(state, runtime, scored=False))

    # endings -----------------------------------------------------------------------

    def _end(self, state: RequestState, reason: Optional[str] = None,
             error: Optional[BaseException] = None) -> None:
        """The one way a request ends: its result or error goes out now; an admitted
        request's target work is released (and its cache kept: prompt and the reply fed)
        in the next plan."""
        if state.finished:
            return
        store = error is None and reason in ("stop", "length") and state.cache_prompt
        state.stored_reply = self._fed(state) if store else None
        admitted = state.status is not Status.WAITING
        state.scoring = None
        self._reserve(state, Reservation())
        if self.runtime is not None:
            self._report_memory(state, self.runtime)
        self._deliver(state, reason, error)
        if not admitted:
            self._forget(state)

    def _deliver(self, state: RequestState, reason: Optional[str],
                 error: Optional[BaseException]) -> None:
        """The request's Result, or its error, to its caller; it is finished from now."""
        state.status = Status.LEAVING
        if error is None:
            state.finish_reason = reason
            state.output.finish(reason, state.usage, state.timings, state.report,
                                state.called, state.warnings)
            return
        logger.warning("request %s failed: %r", state.id, error)
        if not isinstance(error, (EngineFailedError, RequestFailedError, MemoryBudgetError)):
            failure = RequestFailedError(f"request {state.id!r} failed: {error!r}")
            failure.__cause__ = error
            error = failure
        state.finish_reason = "error"
        state.emit(error)
