"""The engine across an `mlx.distributed` group: the target sharded, SPMD, rank 0 leads.

Under `mlx.launch` every rank runs the same program. Each loads its shard of the
target (mlx-lm's `Model.shard`, tensor parallel); rank 0 alone loads the draft and
owns the tokenizer, the worker and the requests. Every forward of the sharded
target holds collectives, so every rank must run the same target work in the same
order: rank 0 broadcasts each turn's plan (`plan.py`) and every rank runs it with the
same executor (`executor.py`). The other ranks keep no state of their own beyond what
the plans build: caches by request handle, the batch, prefix-cache entries by key.

The broadcast is `all_sum` over int32 arrays in which only rank 0 writes: the plan's
length, then the plan. Rank 0 queues it without waiting (a host sync there would wait
for the decode step in flight). The tokens a decode step samples travel inside the
step's graph (an `all_sum` of rank 0's tokens and the others' zeros), so decode stays
pipelined. A group of size 1 is no group: the single-process engine sends nothing.

Liveness: a rank that exits or fails (a follower's error ends its process) breaks the
ring, and rank 0's next collective raises; rank 0 then fails every request and shuts
down. A rank that stops answering without exiting is caught by `Watchdog`: a turn that
takes longer than `rank_timeout` seconds fails every request with a clear error.
"""

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .executor import Executor
from .plan import TurnPlan, decode_plan, encode_plan
from .kv_store import KVStore, serves

logger = logging.getLogger(__name__)


class FollowerRankError(RuntimeError):
    """A request was made on a rank other than 0; only rank 0 serves requests."""


def distributed_group() -> Optional[mx.distributed.Group]:
    """The launcher's group when it has more than one rank, else None."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def agree(group, failed: bool) -> int:
    """Every rank says whether it failed; how many did (all ranks learn the same)."""
    flags = mx.distributed.all_sum(mx.array([int(failed)], dtype=mx.int32), group=group)
    return int(flags.item())


class Channel:
    """Rank 0 posts each turn's plan; the other ranks receive it."""

    def __init__(self, group):
        self.group = group
        self._in_flight: Optional[mx.array] = None  # rank 0's last posted broadcast

    def _post(self, values: np.ndarray) -> None:
        sent = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        mx.async_eval(sent)
        self._in_flight = sent

    def post(self, plan: TurnPlan) -> None:
        body = encode_plan(plan)
        self._post(np.array([body.size], np.int32))
        if body.size:
            self._post(body)
        if plan.shutdown:
            mx.eval(self._in_flight)  # delivered before this rank moves on or exits

    def _exchange(self, size: int) -> np.ndarray:
        zeros = mx.zeros((size,), dtype=mx.int32)
        return np.array(mx.distributed.all_sum(zeros, group=self.group))

    def receive(self) -> TurnPlan:
        size = int(self._exchange(1)[0])
        return decode_plan(self._exchange(size)) if size else TurnPlan()


class Watchdog:
    """On rank 0: calls `on_timeout(seconds)` once if a turn runs longer than `timeout`
    (a rank stopped answering inside a collective, which cannot be interrupted)."""

    def __init__(self, timeout: float, on_timeout: Callable[[float], None]):
        self.timeout, self.on_timeout = timeout, on_timeout
        self.turn_started: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specprefill-watchdog",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            started = self.turn_started
            if started is not None and time.monotonic() - started > self.timeout:
                self.on_timeout(time.monotonic() - started)
                return

    def stop(self) -> None:
        self._stop.set()


class FollowerWorker:
    """A rank > 0's engine: a thread that loads the target's shard, runs the same
    probes as rank 0, then runs rank 0's plans until rank 0 shuts down. It takes no
    requests; `done` resolves when it ends (with rank 0's error if the ring broke)."""

    def __init__(self, load: Callable[[], tuple], group, prefix_cache_bytes: int,
                 name: str = "specprefill-follower"):
        self._load = load
        self.group = group
        self.prefix_cache_bytes = prefix_cache_bytes
        self.closed = False
        self.failure: Optional[BaseException] = None
        self.ready: Future = Future()
        self.done: Future = Future()
        for future in (self.ready, self.done):
            future.set_running_or_notify_cancel()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def check_open(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"this rank's engine failed: {self.failure!r}") from self.failure

    def submit(self, state) -> None:
        raise FollowerRankError(f"rank {self.group.rank()} takes no requests: rank 0 serves "
                                "them and this rank follows")

    def active_ids(self) -> list:
        return []  # never any: requests are made on rank 0

    def find(self, request_id: str) -> None:
        return None

    def stop(self) -> None:
        self.closed = True  # the loop ends on rank 0's word only

    def _main(self) -> None:
        executor = None
        try:
            model = self._load()
            self.ready.set_result(None)
            budget = self.prefix_cache_bytes
            store = KVStore(budget) if serves(model, budget) else None
            executor = Executor(model, store, self.group, sampling=False)
            channel = Channel(self.group)
            while not (plan := channel.receive()).shutdown:
                outcome = executor.run(plan)
                if outcome.failed:  # rank 0 fails these too, by the plans that follow
                    logger.info("rank %d: requests %s failed here", self.group.rank(),
                                sorted(outcome.failed))
            self.done.set_result(None)
        except BaseException as error:
            logger.exception("rank %d: follower failed", self.group.rank())
            self.failure = error
            for future in (self.ready, self.done):
                if not future.done():
                    future.set_exception(error)
        finally:
            if executor is not None:
                executor.clear()
            del executor
            mx.synchronize()
            mx.clear_cache()
            mx.clear_streams()
