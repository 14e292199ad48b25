"""The one thread that does all MLX work for an engine.

Since mlx 0.31 streams are thread-local, so loading, caches, prefill, decode and
freeing all happen here. The thread round-robins one unit of work per active
request (see `run_request`), takes new requests from a queue between units, and
blocks on the queue when idle.
"""

import queue
import threading
from concurrent.futures import Future
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .prefix_cache import PrefixCache, reusable
from .request import Cancelled, Request, run_request
from .runtime import Runtime

_STOP = object()


class Worker:
    def __init__(self, load: Callable[[], Runtime], name: str = "specprefill-worker"):
        self._load = load
        self._inbox: "queue.Queue" = queue.Queue()
        self.ready: Future = Future()
        self.active: list = []  # (request, steps) being worked on; only this thread mutates it
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> Future:
        self.thread.start()
        return self.ready

    def submit(self, request: Request) -> None:
        if not self.thread.is_alive():
            raise RuntimeError("the engine is shut down")
        self._inbox.put(request)

    def stop(self) -> None:
        self._inbox.put(_STOP)

    def _main(self) -> None:
        try:
            runtime = self._load()
        except BaseException as error:  # surfaces in the caller awaiting `ready`
            self.ready.set_exception(error)
            mx.clear_streams()
            return
        prefix_cache = None
        if runtime.config.prefix_cache_bytes and reusable(make_prompt_cache(runtime.model)):
            prefix_cache = PrefixCache(runtime.config.prefix_cache_bytes)
        self.ready.set_result(runtime)
        active = self.active
        try:
            while self._admit(active, runtime, prefix_cache):
                for entry in list(active):
                    if self._step(*entry):
                        active.remove(entry)
        finally:
            for request, steps in active:
                request.cancelled.set()
                self._step(request, steps)
            active.clear()
            if prefix_cache is not None:
                prefix_cache.clear()
            del runtime
            mx.synchronize()
            mx.clear_cache()
            mx.clear_streams()  # a thread exiting with live MLX streams can abort the process

    def _admit(self, active: list, runtime: Runtime, prefix_cache: Optional[PrefixCache]) -> bool:
        """Take queued requests (waiting only when idle); False once told to stop."""
        while True:
            try:
                item = self._inbox.get(block=not active)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            steps = run_request(item, runtime, prefix_cache)
            next(steps)  # to its first yield, inside its error handling
            active.append((item, steps))

    @staticmethod
    def _step(request: Request, steps) -> bool:
        """Advance one request by one unit; True when it has finished."""
        try:
            if request.cancelled.is_set():
                steps.throw(Cancelled())
            else:
                next(steps)
        except StopIteration:
            return True
        except BaseException as error:  # a bug in the lifecycle must not kill the worker
            request.emit(error)
            return True
        return False
