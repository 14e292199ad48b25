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

A rank waiting for the next plan blocks on a doorbell (`doorbell.py`) before the
plan's collective: the ring backend polls while it waits, which would keep a core busy
on every other rank for as long as rank 0 has no plan.

Liveness: a rank that exits or fails (a follower's error ends its process) breaks the
ring, and rank 0's next collective raises; rank 0 then fails every request and shuts
down. A rank that stops answering without exiting is caught by `Watchdog`: a turn that
takes longer than `rank_timeout` seconds fails every request with a clear error.
"""

import logging
import threading
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .doorbell import Doorbell
from .plan import TurnPlan, decode_plan, encode_plan

logger = logging.getLogger(__name__)


def distributed_group() -> Optional[mx.distributed.Group]:
    """The launcher's group when it has more than one rank, else None."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def agree(group, failed: bool) -> int:
    """Every rank says whether it failed; how many did (all ranks learn the same)."""
    flags = mx.distributed.all_sum(mx.array([int(failed)], dtype=mx.int32), group=group)
    return int(flags.item())


class Channel:
    """Rank 0 posts each turn's plan; the other ranks receive it, woken by a
    `Doorbell` (set up with the first plan) rather than polling in the collective."""

    def __init__(self, group):
        self.group = group
        self._in_flight: Optional[mx.array] = None  # rank 0's last posted broadcast
        self._doorbell: Optional[Doorbell] = None

    def _bell(self) -> Doorbell:
        if self._doorbell is None:
            self._doorbell = Doorbell(self.group, agree)
        return self._doorbell

    def _post(self, values: np.ndarray) -> None:
        sent = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        mx.async_eval(sent)
        self._in_flight = sent

    def post(self, plan: TurnPlan) -> None:
        body = encode_plan(plan)
        self._bell().ring()
        self._post(np.array([body.size], np.int32))
        if body.size:
            self._post(body)
        if plan.shutdown:
            mx.eval(self._in_flight)  # delivered before this rank moves on or exits
            self._bell().close()

    def _exchange(self, size: int) -> np.ndarray:
        zeros = mx.zeros((size,), dtype=mx.int32)
        return np.array(mx.distributed.all_sum(zeros, group=self.group))

    def receive(self) -> TurnPlan:
        self._bell().wait()
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
