"""The worker thread: it owns the models and every live request, and runs the loop.

Since mlx 0.31 streams are thread-local, so loading, caches, prefill, decode and
freeing all happen here. Each turn of the loop:
1. takes new requests (blocking only when there is nothing to do) and ends the ones
   whose callers aborted;
2. decides the turn's plan (`plan.py`): the stores and releases of requests that ended,
   the joins of requests whose first token is out, one batched decode step, and one unit
   of prefill work for the oldest admitted request (first come, first served: later
   arrivals never stretch an earlier TTFT), plus a last chunk costing at most a quarter
   of a unit. A turn that starts with a whole short prompt (surely dense, one chunk)
   goes on with the short prompts next in line, up to one unit's cost and four prompts,
   each in its own forward (its KV is what it would be alone), so requests arriving
   together start decoding together;
3. has the executor run the plan (on every rank of a sharded target: `distributed.py`),
   then takes its outcome: tokens to the callers, first tokens sampled from the last
   chunks' logits, each failure to its own request. A request being scored runs one
   unit of the draft's scoring (rank 0 alone) after the plan.
So a decoding stream waits at most about one prefill unit between two tokens. A request
is admitted to prefill while fewer than `max_batch_size` requests are running and
their reserved KV fits `kv_cache_bytes`; otherwise it waits in the queue.

Every request ends with a Result or an error, whatever happens: a failure in any of a
request's steps ends that request alone (`_fail_request`); submission and shutdown are
ordered under one lock, requests still queued at shutdown end with finish_reason
"abort", and if the loop itself fails every caller gets the error.
"""

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..core.sparse_prefill import decode_shift
from ..loading import cache_dir
from .batch import sample_rows
from . import densify
from .delivery import one_delivery
from .disk_cache import FOLDER as DISK_FOLDER, DiskCache, DiskStats
from .distributed import Watchdog
from .executor import Executor, TurnOutcome
from .plan import Join, Store, TurnPlan
from .prefill import (
    PrefixCaches, begin, caches_for, fall_back_to_dense, plan_sparse, score_unit,
    short_prefill_share, unit_chunks,
)
from .prefix_cache import PrefixCache, prefix_cache_for
from .results import Progress
from .runtime import EngineInfo, Runtime
from .state import DECODING, ENDED, SCORING, RequestState

logger = logging.getLogger(__name__)
_STOP = object()
SHORT_PREFILL_FLOOR = 0.25  # the least share of a turn's unit a packed short prefill counts


class EngineFailedError(RuntimeError):
    """The engine's worker thread failed; the message carries the cause."""


class RequestFailedError(RuntimeError):
    """One request failed on the worker (the cause is chained); the engine goes on."""


def make_disk_cache(runtime: Runtime) -> Optional[DiskCache]:
    """The disk tier's folder under both prefix caches, when it has a budget (never on a
    sharded target: `Runtime.identities` are empty there)."""
    config = runtime.config
    if not config.prefix_cache_disk_bytes or not any(runtime.identities):
        return None
    root = Path(config.cache_dir) if config.cache_dir is not None else cache_dir()
    return DiskCache(root / DISK_FOLDER, config.prefix_cache_disk_bytes,
                     config.prefix_cache_disk_bits)


def make_prefix_caches(runtime: Runtime, disk: Optional[DiskCache] = None) -> PrefixCaches:
    """The target's prefix cache (every rank keeps one alike) and the draft's (rank 0),
    each over its model's disk tier in `disk`."""
    config, costs = runtime.config, runtime.costs

    def cache_for(model, budget: int, identity: str, which: str):
        tier = disk.tier(identity) if disk is not None and identity else None

        def predict(tokens: int, cached: int) -> float:
            # before any prefill was measured on this machine the cost model has no
            # seconds, only FLOPs: a read is taken to pay, as every peer restores
            if not (getattr(costs, "target", None) or getattr(costs, "draft", None)):
                return float("inf")
            return costs.predict(which, tokens, cached)

        return prefix_cache_for(model, budget, tier, predict)

    scorer_model = getattr(runtime.scorer, "model", None)
    draft = None
    if scorer_model is not None:
        draft = cache_for(scorer_model, config.draft_prefix_cache_bytes, runtime.identities[1],
                          "draft")
    target = cache_for(runtime.model, config.prefix_cache_bytes, runtime.identities[0], "target")
    return PrefixCaches(target, draft)


class Scheduler:
    def __init__(self, load: Callable[[], Runtime], name: str = "specprefill-worker"):
        self._load = load
        self._lock = threading.Lock()
        self._inbox: "queue.Queue" = queue.Queue()
        self.requests: dict[str, RequestState] = {}  # live requests by id, under the lock
        self.ready: Future = Future()
        self.ready.set_running_or_notify_cancel()  # nobody can cancel shared state
        self.closed = False
        self.failure: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        # worker-only state
        self._waiting: deque = deque()
        self._prefilling: Optional[RequestState] = None  # the admitted head: scoring or prefilling
        self._prefilled: list = []  # last chunk planned this turn: the first token comes next
        self._joining: list = []  # first token out: joins the decode in the next plan
        self._decoding: dict = {}  # handle -> state
        self._leaving: list = []  # (state, store it) ended: released in the next plan
        self._jobs: deque = deque()  # SpecPrefill turns to densify while idle
        self._replacing: dict = {}  # handle of a sparse turn stored this plan -> its job
        self.densify_stats = densify.DensifyStats()
        self.disk_stats: Optional[DiskStats] = None  # the disk tier's, when it has one
        self._reserved = 0
        self._handles = itertools.count(1)
        self.runtime: Optional[Runtime] = None
        self.executor: Optional[Executor] = None
        self._watchdog: Optional[Watchdog] = None

    # caller side ---------------------------------------------------------------

    def check_open(self) -> None:
        if self.failure is not None:
            raise EngineFailedError(f"the engine failed: {self.failure!r}") from self.failure
        if self.closed:
            raise RuntimeError("the engine is shut down")

    def submit(self, state: RequestState) -> None:
        with self._lock:
            self.check_open()
            if state.id in self.requests:
                raise ValueError(f"request_id {state.id!r} is already in flight")
            self.requests[state.id] = state
            self._inbox.put(state)

    def stop(self) -> None:
        """Refuse new requests; the worker aborts what is left and exits."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._inbox.put(_STOP)

    # worker side ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            runtime = self._load()
        except BaseException as error:
            self._fail(error)
            self.ready.set_exception(error)
            mx.clear_streams()
            return
        self.runtime = runtime  # for inspection only: never used off this thread
        disk = make_disk_cache(runtime)
        self.disk_stats = disk.stats if disk is not None else None
        caches = make_prefix_caches(runtime, disk)
        self.executor = Executor(runtime.model, caches.target, runtime.group)
        if runtime.group is not None:
            self._watchdog = Watchdog(runtime.config.rank_timeout, self._rank_lost)
        ranks = runtime.group.size() if runtime.group is not None else 1
        self.ready.set_result(EngineInfo(runtime.tokenizer, runtime.context_length,
                                         not runtime.batch_reason, runtime.batch_reason,
                                         runtime.config.step_size, runtime.vocab_size, ranks))
        try:
            while self._turn(runtime, caches):
                pass
        except BaseException as error:  # a defect in the loop, or a rank lost
            logger.exception("engine worker failed")
            self._fail(error)
        finally:
            if disk is not None and self.failure is None:
                self._keep_last_turns(caches)
            self._abort_all()
            if self._watchdog is not None:
                self._watchdog.stop()
            if runtime.channel is not None and self.failure is None:
                runtime.channel.post(TurnPlan(shutdown=True))  # the other ranks exit
            runtime.costs.save()
            if disk is not None:
                disk.close()  # the queued writes finish; their arrays are let go here
            self.executor.clear()
            if caches.draft is not None:
                caches.draft.clear()
            self.runtime = self.executor = None
            del runtime, caches  # the models are freed here, on their own thread
            mx.synchronize()
            mx.clear_cache()
            mx.clear_streams()  # a thread exiting with live MLX streams can abort the process

    def _busy(self) -> bool:
        return bool(self._prefilling or self._joining or self._decoding or self._leaving)

    def _turn(self, runtime: Runtime, caches: PrefixCaches) -> bool:
        if not self._take_new(block=not self._busy() and not self._waiting and not self._jobs):
            return False
        if self.failure is not None:
            return False
        self._end_aborted()
        plan = TurnPlan()
        self._plan_endings(plan, caches.target)
        self._plan_joins(plan, runtime, caches.target)
        plan.decode = bool(self._decoding)
        scoring = self._plan_prefill(plan, runtime, caches)
        if caches.target is not None:
            self._plan_densify(plan, runtime, caches.target)
            pinned = {r.key for r in plan.restores}
            if self._prefilling is not None and self._prefilling.restore is not None:
                pinned.add(self._prefilling.restore.key)  # held while the request prefills
            evicted = caches.target.evictions(pinned)
            for key in evicted:  # spilled to the disk tier, if there is one
                caches.target.persist(key)
            plan.drops += evicted
        if plan:
            if runtime.channel is not None:
                runtime.channel.post(plan)
            if self._watchdog is not None:
                self._watchdog.turn_started = time.monotonic()
            outcome = self.executor.run(plan, self._row)
            if self._watchdog is not None:
                self._watchdog.turn_started = None
            self._persist(plan, outcome, caches.target)
            self._absorb(plan, outcome, runtime)
            self._densified(plan, outcome)
        if scoring is not None:
            self._score(scoring, runtime, caches)
        return True

    @staticmethod
    def _persist(plan: TurnPlan, outcome: TurnOutcome, target: Optional[PrefixCache]) -> None:
        """A store whose work is released in the same plan is its last (a turn's prompt
        and reply, a finished densify): worth keeping on disk too."""
        if target is None or target.disk is None:
            return
        released = set(plan.releases)
        for store in plan.stores:
            if store.handle in released and store.handle in outcome.stored:
                target.persist(outcome.stored[store.handle])

    def _keep_last_turns(self, caches: PrefixCaches) -> None:
        """At shutdown: the stores of requests that ended after the last plan (their
        results are out, their caches not kept yet), so the disk tier has every turn."""
        plan = TurnPlan()
        self._plan_endings(plan, caches.target)
        if plan.stores:
            try:
                outcome = self.executor.run(plan)
            except Exception as error:  # shutting down: the turn is only not kept
                logger.warning("keeping the last turns at shutdown failed: %r", error)
                return
            self._persist(plan, outcome, caches.target)

    def _row(self, handle: int) -> RequestState:
        return next(s for s in self._joining if s.handle == handle)

    def _take_new(self, block: bool) -> bool:
        """Move submitted requests to the waiting queue; False once told to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            self._waiting.append(item)
            block = False

    def _end_aborted(self) -> None:
        for state in [s for s in self._waiting if s.cancelled.is_set()]:
            self._waiting.remove(state)
            self._finish(state, "abort")
        state = self._prefilling
        if state is not None and state.cancelled.is_set():
            self._prefilling = None
            self._end(state, "abort")
        for state in [s for s in self._joining if s.cancelled.is_set()]:
            self._joining.remove(state)
            self._end(state, "abort")
        for state in [s for s in self._decoding.values() if s.cancelled.is_set()]:
            self._end(state, "abort")

    # planning ------------------------------------------------------------------

    def _plan_endings(self, plan: TurnPlan, target: Optional[PrefixCache]) -> None:
        """Requests that ended: their cache kept for an agent's next turn (prompt and
        reply), then their target work released."""
        for state, replied in self._leaving:
            if replied is not None and target is not None:
                self._plan_store(plan, state, replied)
                if state.positions is not None and self.runtime.config.densify == "idle":
                    self._add_job(plan.stores[-1].tokens, state.handle)
            plan.releases.append(state.handle)
        self._leaving.clear()

    # densify ---------------------------------------------------------------------

    def _add_job(self, tokens: np.ndarray, handle: int) -> None:
        """A SpecPrefill turn to densify, first in line unless a job is under way: the
        newest turn is the one an agent's next turn extends. Queued turns it extends are
        not needed."""
        jobs = [job for job in self._jobs if job.feed is not None or not (
            job.tokens.size <= tokens.size and np.array_equal(job.tokens, tokens[: job.tokens.size]))]
        job = densify.Job(next(self._handles), tokens)
        at = 1 if jobs and jobs[0].feed is not None else 0
        self._jobs = deque(jobs[:at] + [job] + jobs[at:])
        self._replacing[handle] = job

    def _plan_densify(self, plan: TurnPlan, runtime: Runtime, target: PrefixCache) -> None:
        """Keep what the current job computed; give it a unit when nothing else runs."""
        if not self._jobs:
            return
        job = self._jobs[0]
        if job.failed:  # given up, not retried
            plan.releases.append(job.handle)
            self._jobs.popleft()
            return
        densify.plan_store(plan, job)
        if job.feed is not None and job.fed == job.feed.size:  # done: the dense KV replaces
            if job.replaces is not None:  # the sparse entry
                plan.drops.append(job.replaces)
            plan.releases.append(job.handle)
            self._jobs.popleft()
            self.densify_stats.entries += 1
            return
        if self._busy() or self._waiting or plan.chunks:
            return
        if job.feed is None and not densify.start(job, runtime.model, target,
                                                  runtime.config.step_size):
            self._jobs.popleft()  # a dense prefix covers it already
            return
        densify.plan_unit(plan, job)

    def _densified(self, plan: TurnPlan, outcome: TurnOutcome) -> None:
        """The keys sparse turns were stored as (their jobs drop them when done) and
        the densify units' work."""
        for handle, job in list(self._replacing.items()):
            if handle in outcome.stored:
                job.replaces = outcome.stored[handle]
        self._replacing.clear()
        stats = self.densify_stats
        for chunk in plan.chunks:
            if self._jobs and chunk.handle == self._jobs[0].handle:
                stats.tokens += int(chunk.tokens.size)
        if self._jobs:
            job = self._jobs[0]
            stats.seconds += outcome.seconds.get(job.handle, 0.0)
            job.failed = job.handle in outcome.failed
        stats.pending = len(self._jobs)

    @staticmethod
    def _fed(state: RequestState) -> int:
        """Generated tokens whose KV is in the request's cache: a batched row has fed
        every token read back; a solo row samples one ahead."""
        if state.status != DECODING:
            return 0
        return len(state.generated) - (0 if state.report.batched else 1)

    @staticmethod
    def _plan_store(plan: TurnPlan, state: RequestState, replied: int) -> None:
        """Keep the request's cache: its prompt and the first `replied` tokens of its reply."""
        tokens = np.concatenate([state.tokens, np.asarray(state.generated[:replied], np.int32)])
        positions = state.positions
        if positions is not None:
            positions = np.concatenate([positions, state.tokens.size + np.arange(replied)])
        keep = state.report.keep if state.positions is not None else 1.0
        plan.stores.append(Store(state.handle, tokens, positions, keep, densified=state.densified))

    def _plan_joins(self, plan: TurnPlan, runtime: Runtime,
                    target: Optional[PrefixCache]) -> None:
        for state in self._joining:
            if state.cache_prompt and target is not None and state.positions is None:
                self._plan_store(plan, state, replied=0)  # the prompt's KV
            plan.joins.append(Join(state.handle, state.first_token, state.shift,
                                   solo=bool(runtime.batch_reason)))

    def _plan_prefill(self, plan: TurnPlan, runtime: Runtime,
                      caches: PrefixCaches) -> Optional[RequestState]:
        """One unit of the oldest prefill; the request whose scoring unit runs this turn,
        if that is the unit. A turn that starts with a whole short prompt goes on with
        the short prompts next in line while the unit's cost is not spent; each counts
        at least `SHORT_PREFILL_FLOOR` of it (a forward, its sync and the first token
        cost host time whatever the length), so at most four share a turn."""
        spent = 0.0  # share of the unit
        while True:
            share = None
            if self._prefilling is None:
                if not self._waiting or self._waiting[0].cancelled.is_set():
                    return None  # a cancelled request ends at the next turn's start
                share = short_prefill_share(self._waiting[0], runtime)
                if share is not None:
                    share = max(share, SHORT_PREFILL_FLOOR)
                if spent and (share is None or spent + share > 1 + 1e-9):
                    return None  # it waits for a turn of its own
                if not self._admit(runtime, caches):
                    return None
                if self._prefilling is None:
                    continue  # it failed at admission
            state = self._prefilling
            if state.status == SCORING:
                return state
            self._plan_unit(plan, state)
            if self._prefilling is not None or share is None:
                return None  # a prefill spanning units spends the whole turn
            spent += share

    def _plan_unit(self, plan: TurnPlan, state: RequestState) -> None:
        """The request's next chunks, up to one a scheduler turn may follow."""
        if state.fed == 0:
            plan.restores.append(state.restore)
        chunks, state.fed = unit_chunks(state.handle, state.feed, state.feed_positions,
                                        state.fed, state.chunk_ends, int(state.tokens.size),
                                        state.checkpoints)
        plan.chunks += chunks
        if state.fed == state.feed.size:
            self._prefilling = None
            self._prefilled.append(state)

    def _admit(self, runtime: Runtime, caches: PrefixCaches) -> bool:
        """Start the oldest waiting request's prefill, if the batch and KV budget allow."""
        state = self._waiting[0]
        running = len(self._decoding) + len(self._joining)
        need = (state.tokens.size + state.max_tokens) * runtime.kv_bytes_per_token
        budget = runtime.config.kv_cache_bytes
        if running >= runtime.config.max_batch_size:
            return False
        if budget is not None and running and self._reserved + need > budget:
            return False  # it waits; a request alone is always admitted
        self._waiting.popleft()
        state.handle = next(self._handles)
        state.reserved_bytes = need
        self._reserved += need
        try:
            state.start()
            begin(state, runtime, caches)
        except Exception as error:
            self._fail_request(state, error)
            return True
        self._prefilling = state
        return True

    # outcomes ------------------------------------------------------------------

    def _absorb(self, plan: TurnPlan, outcome: TurnOutcome, runtime: Runtime) -> None:
        failed = outcome.failed
        live = {s.handle: s for s in (*self._joining, *self._prefilled, *self._decoding.values())}
        if self._prefilling is not None:
            live[self._prefilling.handle] = self._prefilling
        for handle, error in failed.items():
            state = live.get(handle)
            if state is not None:
                self._end(state, error=error)
        for state in self._joining:
            if state.handle not in failed and not state.finished:
                state.status = DECODING
                state.report.batched = not runtime.batch_reason
                state.report.batch_reason = runtime.batch_reason or "decoding in the shared batch"
                self._decoding[state.handle] = state
        self._joining = []
        ended = []
        with one_delivery():  # the step's tokens reach each caller loop in one hand-over
            for row, token in outcome.tokens:
                if row.finished or row.handle in failed:
                    continue
                try:
                    reason = row.output.accept(token)
                except Exception as error:
                    self._end(row, error=error)
                    continue
                if reason is not None:
                    ended.append((row, reason))
        for row, reason in ended:
            self._end(row, reason)
        for handle in dict.fromkeys(chunk.handle for chunk in plan.chunks):
            state = live.get(handle)
            if state is None or state.finished:
                continue
            state.prefill_busy += outcome.seconds.get(handle, 0.0)
            if state.progress:
                state.emit(Progress("prefill", state.fed, int(state.feed.size)))
        prefilled, self._prefilled = self._prefilled, []
        for state in prefilled:
            if not state.finished:
                self._first_token(state, outcome.logits[state.handle], runtime)

    def _first_token(self, state: RequestState, logits, runtime: Runtime) -> None:
        """Sample from the prefill's logits and hand the token out; the request joins a
        decode in the next plan."""
        state.timings.prefill = time.perf_counter() - state.started - state.timings.scoring
        try:
            state.shift = decode_shift(runtime.model, self.executor.cache_of(state.handle),
                                       int(state.tokens.size), 0)
            token = sample_rows([state], logits).item()
            state.generated.append(token)
            reason = state.output.accept(token)
        except Exception as error:
            self._end(state, error=error)
            return
        runtime.costs.observe("target", int(state.feed.size), state.cached, state.prefill_busy)
        state.first_token = token
        if reason is not None:
            self._end(state, reason)
            return
        self._joining.append(state)

    def _score(self, state: RequestState, runtime: Runtime, caches: PrefixCaches) -> None:
        """One unit of the draft's scoring (rank 0 alone); at its end, the selection."""
        if state.cancelled.is_set():
            return  # ends at the next turn's start
        caches = caches_for(state, caches)
        started = time.perf_counter()
        try:
            importance = score_unit(state, runtime, caches.draft)
            state.scoring_busy += time.perf_counter() - started
            if state.progress:
                state.emit(Progress("scoring", *state.scored))
            if importance is None:
                return
            state.timings.scoring = time.perf_counter() - state.started
            cached = state.usage.draft_cached_tokens
            runtime.costs.observe("draft", int(state.tokens.size) - cached, cached,
                                  state.scoring_busy)
            plan_sparse(state, runtime, caches, importance)
        except Exception as error:  # SpecPrefill's own step: the request goes on densely
            fall_back_to_dense(state, runtime, caches, error)

    # endings -------------------------------------------------------------------

    def _end(self, state: RequestState, reason: Optional[str] = None,
             error: Optional[BaseException] = None) -> None:
        """The one way a running request ends: its result or error goes out now, its
        target work is released (and its cache kept) in the next plan."""
        if state.finished:
            return
        self._decoding.pop(state.handle, None)
        if self._prefilling is state:
            self._prefilling = None
        state.scoring = state.scoring_cache = None
        keep = error is None and reason in ("stop", "length") and state.cache_prompt
        self._leaving.append((state, self._fed(state) if keep else None))
        state.status = ENDED
        if error is not None:
            self._fail_request(state, error)
        else:
            self._finish(state, reason)

    def _release(self, state: RequestState) -> bool:
        """Forget a request; False if it had already ended."""
        if state.finished:
            return False
        state.finished = True
        self._reserved -= state.reserved_bytes
        with self._lock:
            if self.requests.get(state.id) is state:
                del self.requests[state.id]
        return True

    def _finish(self, state: RequestState, reason: str) -> None:
        if not self._release(state):
            return
        state.finish_reason = reason
        state.output.finish(reason, state.usage, state.timings, state.report, state.submitted,
                            state.warnings)

    def _fail_request(self, state: RequestState, error: BaseException) -> None:
        if self._release(state):
            logger.warning("request %s failed: %r", state.id, error)
            if not isinstance(error, (EngineFailedError, RequestFailedError)):
                failure = RequestFailedError(f"request {state.id!r} failed: {error!r}")
                failure.__cause__ = error
                error = failure
            state.finish_reason = "error"
            state.emit(error)

    def _fail(self, error: BaseException) -> None:
        """The worker cannot go on: every live request gets an error naming the cause."""
        with self._lock:
            self.failure = error
            self.closed = True
            live = list(self.requests.values())
        failed = EngineFailedError(f"the engine failed: {error!r}")
        for state in live:
            self._fail_request(state, failed)

    def _rank_lost(self, seconds: float) -> None:
        """The watchdog's call (its own thread): a turn has not ended for `seconds`."""
        logger.error("a rank did not answer for %.0f s: failing every request", seconds)
        self._fail(TimeoutError(f"a rank of the sharded target did not answer within "
                                f"{self.runtime.config.rank_timeout:.0f} s"))

    def _abort_all(self) -> None:
        """At shutdown: every request still running or queued ends with "abort"."""
        with self._lock:
            self.closed = True
        self._take_new(block=False)  # whatever was submitted before the stop
        running = [self._prefilling, *self._prefilled, *self._joining,
                   *self._decoding.values(), *self._waiting]
        for state in running:
            if state is not None:
                self._finish(state, "abort")
        self._prefilling, self._prefilled, self._joining = None, [], []
        self._jobs.clear()
        self._decoding.clear()
        self._leaving.clear()
        self._waiting.clear()
        with self._lock:
            orphans = list(self.requests.values())
        for state in orphans:  # defensive: anything registered but never seen
            self._finish(state, "abort")

