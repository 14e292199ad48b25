"""The worker thread: it owns the models, and runs the loop.

Since mlx 0.31 streams are thread-local, so loading, caches, prefill, decode and
freeing all happen here. The loop is the worker's whole job: take what came in its
mailbox (blocking only when the scheduler has nothing to do), ask the scheduler for
the turn's plan (`scheduler.py`), have the executor run it (`executor.py`; the
target's part on every rank of a sharded target: `distributed.py`, the other ranks
running `follower.py`), and hand the scheduler the outcome. Submission and shutdown
are ordered under the table's lock; requests still queued at shutdown end with
finish_reason "abort". If the loop itself fails, every caller gets the error naming
the cause (`_fail`).
"""

import logging
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..loading import cache_dir
from .disk_cache import FOLDER as DISK_FOLDER, DiskCache, DiskStats
from .distributed import Watchdog
from .executor import Executor
from .kv_store import KVStore
from .plan import TurnPlan
from .prefix_cache import PrefixIndexes, prefix_cache_for
from .runtime import EngineInfo, Runtime
from .scheduler import EngineFailedError, Scheduler
from .state import RequestState

logger = logging.getLogger(__name__)
_STOP = object()


def make_disk_cache(runtime: Runtime) -> Optional[DiskCache]:
    """The disk tier's folder under both prefix caches, when it has a budget (never on a
    sharded target: `Runtime.identities` are empty there)."""
    config = runtime.config
    if not config.prefix_cache_disk_bytes or not any(runtime.identities):
        return None
    root = Path(config.cache_dir) if config.cache_dir is not None else cache_dir()
    return DiskCache(root / DISK_FOLDER, config.prefix_cache_disk_bytes,
                     config.prefix_cache_disk_bits)


def make_prefix_caches(runtime: Runtime, disk: Optional[DiskCache] = None
                       ) -> tuple[PrefixIndexes, list]:
    """The indexes of the target's prefix cache and of the draft's (the planner's), and
    their tensors' stores (the executor's: the target's, the draft's; None where there is
    no cache), each over its model's disk tier in `disk`."""
    config, costs = runtime.config, runtime.costs

    def cache_for(model, budget: int, identity: str, which: str):
        tier = disk.tier(identity) if disk is not None and identity else None

        def predict(tokens: int, cached: int) -> float:
            # until a long prefill was measured on this machine the cost model's rates
            # are its prior, FLOPs without seconds: a read is taken to pay, as every
            # peer restores
            return costs.predict(which, tokens, cached) if costs.measured() else float("inf")

        index = prefix_cache_for(model, budget, tier, predict)
        return index, (KVStore(budget, disk=tier) if index is not None else None)

    scorer_model = getattr(runtime.scorer, "model", None)
    draft, draft_store = None, None
    if scorer_model is not None:
        draft, draft_store = cache_for(scorer_model, config.draft_prefix_cache_bytes,
                                       runtime.identities[1], "draft")
    target, store = cache_for(runtime.model, config.prefix_cache_bytes, runtime.identities[0],
                              "target")
    return PrefixIndexes(target, draft), [store, draft_store]


class Worker:
    def __init__(self, load: Callable[[], Runtime], name: str = "specprefill-worker"):
        self._load = load
        self.scheduler = Scheduler()
        self._inbox: "queue.Queue" = queue.Queue()
        self.ready: Future = Future()
        self.ready.set_running_or_notify_cancel()  # nobody can cancel shared state
        self.closed = False
        self.failure: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.disk_stats: Optional[DiskStats] = None  # the disk tier's, when it has one
        self.vouch = None  # the runtime's `DraftCheck` (it holds no model), once loaded
        self.rank_timeout = 0.0  # the sharded target's, for the watchdog's message
        # the loop's own, read elsewhere only by tests that run on this thread
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
        with self.scheduler.lock:
            self.check_open()
            self.scheduler.add(state)
            self._inbox.put(state)

    def active_ids(self) -> list:
        return self.scheduler.active_ids()

    def find(self, request_id: str) -> Optional[RequestState]:
        return self.scheduler.find(request_id)

    def stop(self) -> None:
        """Refuse new requests; the worker aborts what is left and exits."""
        with self.scheduler.lock:
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
        self.runtime = runtime
        self.vouch = runtime.vouch
        self.rank_timeout = runtime.config.rank_timeout
        disk = make_disk_cache(runtime)
        self.disk_stats = disk.stats if disk is not None else None
        caches, (store, draft_store) = make_prefix_caches(runtime, disk)
        self.executor = Executor(runtime.model, store, runtime.group,
                                 scorer=runtime.scorer, draft_prefix=draft_store, kv=runtime.kv)
        scheduler = self.scheduler
        scheduler.start(runtime, caches, self.executor.register)
        if runtime.group is not None:
            self._watchdog = Watchdog(runtime.config.rank_timeout, self._rank_lost)
        ranks = runtime.group.size() if runtime.group is not None else 1
        self.ready.set_result(EngineInfo(runtime.tokenizer, runtime.context_length,
                                         not runtime.batch_reason, runtime.batch_reason,
                                         runtime.config.step_size, runtime.vocab_size, ranks,
                                         memory=runtime.memory, rates=runtime.rates))
        try:
            while self._turn(runtime):
                pass
        except BaseException as error:  # a defect in the loop, or a rank lost
            logger.exception("engine worker failed")
            self._fail(error)
        finally:
            if disk is not None and self.failure is None:
                scheduler.closing(self.executor.run)
            with scheduler.lock:
                self.closed = True
            scheduler.abort_all()
            if self._watchdog is not None:
                self._watchdog.stop()
            if runtime.channel is not None and self.failure is None:
                runtime.channel.post(TurnPlan(shutdown=True))  # the other ranks exit
            runtime.costs.save()
            if disk is not None:
                disk.close()  # the queued writes finish; their arrays are let go here
            self.executor.clear()
            scheduler.start(None, None, None)  # it holds nothing of the models
            self.runtime = self.executor = None
            del runtime, caches  # the models are freed here, on their own thread
            mx.synchronize()
            mx.clear_cache()
            mx.clear_streams()  # a thread exiting with live MLX streams can abort the process

    def _turn(self, runtime: Runtime) -> bool:
        """One turn of the loop: False once told to stop or failed."""
        if not self._take_new(block=self.scheduler.idle()) or self.failure is not None:
            return False
        plan = self.scheduler.schedule()
        outcome = None
        if plan:
            if runtime.channel is not None and plan.targets():
                runtime.channel.post(plan)
            if self._watchdog is not None:
                self._watchdog.turn_started = time.monotonic()
            outcome = self.executor.run(plan)
            if self._watchdog is not None:
                self._watchdog.turn_started = None
        self.scheduler.update(plan, outcome)
        return True

    def _take_new(self, block: bool) -> bool:
        """Wait for a submission when there is nothing to do; False once told to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            block = False

    def _fail(self, error: BaseException) -> None:
        """The worker cannot go on: every live request gets an error naming the cause."""
        with self.scheduler.lock:
            self.failure = error
            self.closed = True
        self.scheduler.fail_all(EngineFailedError(f"the engine failed: {error!r}"))

    def _rank_lost(self, seconds: float) -> None:
        """The watchdog's call (its own thread): a turn has not ended for `seconds`."""
        logger.error("a rank did not answer for %.0f s: failing every request", seconds)
        self._fail(TimeoutError(f"a rank of the sharded target did not answer within "
                                f"{self.rank_timeout:.0f} s"))
