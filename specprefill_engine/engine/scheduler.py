"""The worker thread: it owns the models and every live request, and runs the loop.

Since mlx 0.31 streams are thread-local, so loading, caches, prefill, decode and
freeing all happen here. Each turn of the loop:
1. takes new requests (blocking only when there is nothing to do) and ends
   the ones whose callers aborted;
2. advances the oldest admitted prefill by one unit of at most `step_size` tokens
   (first come, first served: later arrivals never stretch an earlier TTFT), plus a
   last chunk costing at most a quarter of a unit, and samples its first token when
   that was the last unit; a turn that starts with a whole short prompt (surely dense,
   one chunk) goes on with the short prompts next in line, up to one unit's cost and
   four prompts, each in its own forward (its KV is what it would be alone), so
   requests arriving together start decoding together;
3. runs one batched decode step for every decoding request.
So a decoding stream waits at most about one prefill unit between two tokens. A request
is admitted to prefill while fewer than `max_batch_size` requests are running and
their reserved KV fits `kv_cache_bytes`; otherwise it waits in the queue.

Every request ends with a Result or an error, whatever happens: submission and
shutdown are ordered under one lock, requests still queued at shutdown end with
finish_reason "abort", and if the thread fails every caller gets the error.
"""

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .batch import DecodeBatch, SoloDecode, sample_rows
from .delivery import one_delivery
from .distributed import FROM_BATCH, FROM_SOLO, JOIN_BATCH, JOIN_DROP, JOIN_SOLO, Leader
from .prefill import PrefixCaches, prefill_steps, short_prefill_share
from .prefix_cache import PrefixCache, reusable
from .results import Progress
from .runtime import EngineInfo, Runtime
from .state import RequestState

logger = logging.getLogger(__name__)
_STOP = object()
SHORT_PREFILL_FLOOR = 0.25  # the least share of a turn's unit a packed short prefill counts


class EngineFailedError(RuntimeError):
    """The engine's worker thread failed; the message carries the cause."""


class RequestFailedError(RuntimeError):
    """One request failed on the worker (the cause is chained); the engine goes on."""


def make_prefix_caches(runtime: Runtime) -> PrefixCaches:
    """Prefix caches for the models whose caches can be cut to any prefix."""
    config, caches = runtime.config, PrefixCaches()
    if config.prefix_cache_bytes and reusable(make_prompt_cache(runtime.model)):
        caches.target = PrefixCache(config.prefix_cache_bytes)
    scorer_model = getattr(runtime.scorer, "model", None)
    if config.draft_prefix_cache_bytes and scorer_model is not None \
            and reusable(make_prompt_cache(scorer_model)):
        caches.draft = PrefixCache(config.draft_prefix_cache_bytes)
    return caches


def _keep_for_next_turn(target: PrefixCache, row: RequestState, group,
                        leader: Optional[Leader]) -> None:
    """Store a finished request's cache, prompt and reply, for an agent's next turn."""
    cache = group.extract(row)
    prompt_entries = row.tokens.size if row.positions is None else row.positions.size
    replied = min(len(row.generated), cache[0].offset - prompt_entries)
    if replied < 0:
        return
    tokens = np.concatenate([row.tokens, np.asarray(row.generated[:replied], np.int32)])
    positions = row.positions
    if positions is not None:
        positions = np.concatenate([positions, row.tokens.size + np.arange(replied)])
    key = target.store(tokens, cache, positions)
    if leader is not None:
        source = FROM_SOLO if isinstance(group, SoloDecode) else FROM_BATCH
        count = tokens.size if positions is None else positions.size
        leader.stored(target, source, row.handle, key, count)


class Scheduler:
    def __init__(self, load: Callable[[], Runtime], make_constraint: Optional[Callable] = None,
                 name: str = "specprefill-worker"):
        self._load = load
        self._make_constraint = make_constraint
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
        self._prefilling: Optional[RequestState] = None
        self._decoding: list = []  # DecodeBatch and SoloDecode groups
        self._reserved = 0
        self._handles = itertools.count(1)
        self._leader: Optional[Leader] = None  # rank 0's channel when the target is sharded
        self.runtime: Optional[Runtime] = None

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
        self._leader = runtime.leader
        caches = make_prefix_caches(runtime)
        if caches.target is not None:
            caches.target.track = runtime.leader is not None
        ranks = runtime.group.size() if runtime.group is not None else 1
        self.ready.set_result(EngineInfo(runtime.tokenizer, runtime.context_length,
                                         not runtime.batch_reason, runtime.batch_reason,
                                         runtime.config.step_size, runtime.vocab_size, ranks))
        try:
            while self._turn(runtime, caches):
                pass
        except BaseException as error:  # a defect in the loop: every caller hears of it
            logger.exception("engine worker failed")
            self._fail(error)
        finally:
            self._abort_all()
            if self._leader is not None:
                self._leader.shutdown()  # the other ranks free their shards and exit
                self._leader = None
            self._decoding.clear()
            for store in (caches.target, caches.draft):
                if store is not None:
                    store.clear()
            self.runtime = None
            del runtime, caches  # the models are freed here, on their own thread
            mx.synchronize()
            mx.clear_cache()
            mx.clear_streams()  # a thread exiting with live MLX streams can abort the process

    def _turn(self, runtime: Runtime, caches: PrefixCaches) -> bool:
        busy = self._prefilling is not None or any(self._decoding)
        if not self._take_new(block=not busy and not self._waiting):
            return False
        self._end_aborted()
        self._prefill_turn(runtime, caches)
        for group in list(self._decoding):
            if group.rows:
                self._decode_step(group, caches.target)
        self._decoding = [group for group in self._decoding if len(group.rows)]
        return True

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
            if state.prefill is not None:
                state.prefill.close()
            self._prefilling = None
            self._finish(state, "abort")
        for group in self._decoding:
            leaving = {row for row in group.rows if row.cancelled.is_set()}
            if leaving:
                self._leave(group, leaving)
                for row in leaving:
                    self._finish(row, "abort")

    def _prefill_turn(self, runtime: Runtime, caches: PrefixCaches) -> None:
        """One unit of the oldest prefill. A turn that starts with a whole short prompt
        goes on with the short prompts next in line while the unit's cost is not spent;
        each counts at least `SHORT_PREFILL_FLOOR` of it (a forward, its sync and the
        first token cost host time whatever the length), so at most four share a turn."""
        spent = 0.0  # share of the unit
        while True:
            share = None
            if self._prefilling is None:
                if not self._waiting or self._waiting[0].cancelled.is_set():
                    return  # a cancelled request ends at the next turn's start
                share = short_prefill_share(self._waiting[0], runtime)
                if share is not None:
                    share = max(share, SHORT_PREFILL_FLOOR)
                if spent and (share is None or spent + share > 1 + 1e-9):
                    return  # it waits for a turn of its own
                if not self._admit(runtime):
                    return
            self._prefill_unit(runtime, caches)
            if self._prefilling is not None or share is None:
                return  # a prefill spanning units spends the whole turn
            spent += share

    def _admit(self, runtime: Runtime) -> bool:
        """Start the oldest waiting request's prefill, if the batch and KV budget allow."""
        state = self._waiting[0]
        running = sum(len(group.rows) for group in self._decoding)
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
        state.start(runtime.tokenizer, self._make_constraint)
        self._prefilling = state
        return True

    def _prefill_unit(self, runtime: Runtime, caches: PrefixCaches) -> None:
        state = self._prefilling
        if state.prefill is None:
            state.prefill = prefill_steps(state, runtime, caches)
        try:
            while True:
                phase, done, total = next(state.prefill)
                if state.progress:
                    state.emit(Progress(phase, done, total))
                # after the last unit, go on: the first token comes in this turn (the
                # next step ends the prefill), not after one more decode step
                if phase != "prefill" or done < total:
                    return
        except StopIteration as finished:
            self._prefilling = None
            cache, logits, shift = finished.value
            state.timings.prefill = time.perf_counter() - state.started - state.timings.scoring
            self._first_token(runtime, state, cache, logits, shift)
            return
        except Exception as error:
            self._prefilling = None
            self._fail_request(state, error)

    def _first_token(self, runtime: Runtime, state: RequestState, cache: list, logits,
                     shift: int) -> None:
        """Sample from the prefill's logits, hand the token out, then join a decode."""
        try:
            token = sample_rows([state], logits[:, -1, :]).item()
        except Exception as error:
            state.error = error
        leader = runtime.leader
        if state.error is not None:
            if leader is not None:
                leader.join(state.handle, JOIN_DROP)
            self._fail_request(state, state.error)
            return
        state.generated.append(token)
        reason = state.output.accept(token)
        if reason is not None:
            if leader is not None:
                leader.join(state.handle, JOIN_DROP)
            self._finish(state, reason)
            return
        state.report.batched = not runtime.batch_reason
        state.report.batch_reason = runtime.batch_reason or "decoding in the shared batch"
        if leader is not None:
            leader.join(state.handle, JOIN_SOLO if runtime.batch_reason else JOIN_BATCH,
                        token, shift)
        if runtime.batch_reason:
            self._decoding.append(SoloDecode(runtime.model, state, cache, token, shift,
                                             runtime.group))
            return
        batch = next((g for g in self._decoding if isinstance(g, DecodeBatch)), None)
        if batch is None:
            batch = DecodeBatch(runtime.model, runtime.group)
            self._decoding.append(batch)
        batch.add(state, cache, token, shift)

    def _decode_step(self, group, target: Optional[PrefixCache]) -> None:
        if self._leader is not None:
            self._leader.step(group)
        try:
            produced = group.step()
        except Exception as error:  # e.g. out of memory: these rows fail, the engine goes on
            rows = list(group.rows)
            self._leave(group, set(rows))
            for row in rows:
                self._fail_request(row, error)
            return
        finished = {}
        with one_delivery():  # the step's tokens reach each caller loop in one hand-over,
            for row, token in produced:  # before any finished row's KV is stored
                if row.error is None and (reason := row.output.accept(token)) is not None:
                    finished[row] = reason
        failed = [row for row in group.rows if row.error is not None]
        if target is not None:
            for row in finished:
                if row.cache_prompt:
                    _keep_for_next_turn(target, row, group, self._leader)
        if finished or failed:
            self._leave(group, {*finished, *failed})
        for row in failed:
            self._fail_request(row, row.error)
        for row, reason in finished.items():
            self._finish(row, reason)

    def _leave(self, group, rows: set) -> None:
        if self._leader is not None:
            self._leader.remove(group, rows)
        if isinstance(group, DecodeBatch):
            group.remove(rows)
        else:
            group.rows.clear()

    # endings -------------------------------------------------------------------

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
        state.output.finish(reason, state.usage, state.timings, state.report, state.submitted,
                            state.warnings)

    def _fail_request(self, state: RequestState, error: BaseException) -> None:
        if self._release(state):
            logger.warning("request %s failed: %r", state.id, error)
            if not isinstance(error, (EngineFailedError, RequestFailedError)):
                failure = RequestFailedError(f"request {state.id!r} failed: {error!r}")
                failure.__cause__ = error
                error = failure
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

    def _abort_all(self) -> None:
        """At shutdown: every request still running or queued ends with "abort"."""
        with self._lock:
            self.closed = True
        self._take_new(block=False)  # whatever was submitted before the stop
        if self._prefilling is not None and self._prefilling.prefill is not None:
            self._prefilling.prefill.close()
        rows = [row for group in self._decoding for row in group.rows]
        for state in [self._prefilling, *rows, *self._waiting]:
            if state is not None:
                self._finish(state, "abort")
        self._prefilling = None
        self._waiting.clear()
        with self._lock:
            orphans = list(self.requests.values())
        for state in orphans:  # defensive: anything registered but never seen
            self._finish(state, "abort")
