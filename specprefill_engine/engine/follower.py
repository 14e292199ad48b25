"""A rank > 0 under `mlx.launch`: it takes no requests and runs rank 0's plans with the
same executor, so every rank runs the same target work in the same order
(`distributed.py` says how the plans travel)."""

import logging
import threading
from concurrent.futures import Future
from typing import Callable, Optional

import mlx.core as mx

from .distributed import Channel
from .executor import Executor
from .kv_store import KVStore, serves

logger = logging.getLogger(__name__)


class FollowerRankError(RuntimeError):
    """A request was made on a rank other than 0; only rank 0 serves requests."""


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
