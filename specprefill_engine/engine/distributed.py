"""The engine across an `mlx.distributed` group: the target sharded, SPMD, rank 0 leads.

Under `mlx.launch` every rank runs the same program. Each loads its shard of the
target (mlx-lm's `Model.shard`, tensor parallel); rank 0 alone loads the draft and
owns the tokenizer, the scheduler and the requests. Every target operation
(cache restore, prefill chunk, decode step, batch join/leave, prefix-cache store)
must run in the same order on every rank, since each forward holds collectives. So
rank 0 announces each one on a command channel before running it, and the other
ranks (`serve`) replay it with the same calls and arguments.

The channel is `all_sum` over int32 arrays in which only rank 0 writes (a
broadcast): a fixed header, then a payload of the length the header names. The
tokens a decode step samples travel inside the step's graph (an `all_sum` of rank
0's tokens and the followers' zeros), so decode stays pipelined. A group of size 1
is no group: the single-process engine sends nothing.
"""

import logging
import threading
from concurrent.futures import Future
from typing import Callable, Generator, Optional

import mlx.core as mx
import numpy as np

from .batch import DecodeBatch, SoloDecode
from .prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

HEADER = 8
(RESTORE, DENSE, SPARSE, NEXT, RELEASE, JOIN, STEP, REMOVE, STORE, CALIBRATE,
 SHUTDOWN) = range(1, 12)
JOIN_DROP, JOIN_BATCH, JOIN_SOLO = 0, 1, 2
FROM_PREFILL, FROM_BATCH, FROM_SOLO = 0, 1, 2


class FollowerRankError(RuntimeError):
    """A request was made on a rank other than 0; only rank 0 serves requests."""


def distributed_group() -> Optional[mx.distributed.Group]:
    """The launcher's group when it has more than one rank, else None."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


class Channel:
    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self._in_flight: Optional[mx.array] = None  # rank 0's last posted broadcast

    def _exchange(self, values: np.ndarray) -> np.ndarray:
        return np.array(mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group))

    def _post(self, values: np.ndarray) -> None:
        """Rank 0's side of an exchange: it knows what it sends, so it queues the
        collective without waiting for it (a host sync here would wait for the decode
        step in flight on the same stream, and undo decode pipelining)."""
        sent = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        mx.async_eval(sent)
        self._in_flight = sent

    def send(self, op: int, *args: int, payload=None) -> None:
        """Rank 0 only: one command, its header then its payload."""
        payload = np.zeros(0, np.int32) if payload is None else np.asarray(payload, np.int32)
        header = np.zeros(HEADER, np.int32)
        header[0], header[1] = op, payload.size
        header[2 : 2 + len(args)] = args
        self._post(header)
        if payload.size:
            self._post(payload)

    def receive(self) -> tuple[int, list, np.ndarray]:
        """Ranks > 0: the next command (op, header arguments, payload)."""
        header = self._exchange(np.zeros(HEADER, np.int32))
        size = int(header[1])
        payload = self._exchange(np.zeros(size, np.int32)) if size else np.zeros(0, np.int32)
        return int(header[0]), [int(v) for v in header[2:]], payload


class Leader(Channel):
    """Rank 0's side: announces each target operation just before running it."""

    def restore(self, handle: int, hit, cut: int) -> None:
        key, count = -1, 0
        if hit is not None and cut > 0:
            key, count = hit.entry.key, hit.entry.count_before(cut)
        self.send(RESTORE, handle, key, count)

    def prefill(self, handle: int, steps: Generator, tokens: np.ndarray, step_size: int,
                kept: Optional[np.ndarray] = None, cut: int = 0) -> Generator:
        """`steps` (a core prefill generator), each chunk announced; a prefill left
        early (cancelled, failed) is released on every rank."""
        if kept is None:
            self.send(DENSE, handle, step_size, payload=tokens)
        else:
            self.send(SPARSE, handle, step_size, cut, tokens.size,
                      payload=np.concatenate([tokens, kept]))
        finished = False
        try:
            while True:
                self.send(NEXT, handle)
                try:
                    item = next(steps)
                except StopIteration as done:
                    finished = True
                    return done.value
                yield item
        finally:
            if not finished:
                steps.close()
                self.send(RELEASE, handle)

    def join(self, handle: int, mode: int, token: int = 0, shift: int = 0) -> None:
        self.send(JOIN, handle, mode, token, shift)

    def step(self, group) -> None:
        self.send(STEP, group.row.handle if isinstance(group, SoloDecode) else -1)

    def remove(self, group, rows) -> None:
        if isinstance(group, SoloDecode):
            self.send(REMOVE, group.row.handle)
        else:
            self.send(REMOVE, -1, payload=[row.handle for row in rows])

    def stored(self, store: PrefixCache, source: int, handle: int, key: Optional[int],
               count: int) -> None:
        """After `store.store`: the entry it kept (if any) and the ones it dropped."""
        dropped, store.dropped = store.dropped, []
        if key is not None or dropped:
            self.send(STORE, source, handle, -1 if key is None else key, count, payload=dropped)

    def calibrate(self, step_size: int) -> None:
        self.send(CALIBRATE, step_size)

    def shutdown(self) -> None:
        self.send(SHUTDOWN)
        mx.eval(self._in_flight)  # delivered before this rank moves on or exits


class _Row:
    """A follower's stand-in for a request in a batch: only its identity matters."""

    __slots__ = ("handle", "processors")

    def __init__(self, handle: int):
        self.handle, self.processors = handle, []


class Follower(Channel):
    """Ranks > 0: replay rank 0's target operations until it shuts down."""

    def __init__(self, group, model):
        super().__init__(group)
        self.model = model
        self.caches: dict = {}  # handle -> prompt cache while prefilling
        self.prefills: dict = {}  # handle -> core prefill generator
        self.shifts: dict = {}
        self.entries: dict = {}  # prefix-cache key -> per-layer (keys, values)
        self.batch: Optional[DecodeBatch] = None
        self.rows: dict = {}  # handle -> stand-in row in the batch
        self.solo: dict = {}  # handle -> SoloDecode

    def serve(self) -> None:
        while True:
            op, args, payload = self.receive()
            if op == SHUTDOWN:
                return
            self._run(op, args, payload)

    def _run(self, op: int, args: list, payload: np.ndarray) -> None:
        from ..core import chunked_prefill, sparse_prefill_steps
        from mlx_lm.models.cache import make_prompt_cache

        handle = args[0]
        if op == RESTORE:
            key, count = args[1], args[2]
            cache = make_prompt_cache(self.model)
            if key >= 0:
                for layer, (keys, values) in zip(cache, self.entries[key]):
                    layer.keys, layer.values = keys[..., :count, :], values[..., :count, :]
                    layer.offset = count
            self.caches[handle] = cache
        elif op == DENSE:
            self.prefills[handle] = chunked_prefill(self.model, mx.array(payload),
                                                    self.caches[handle], args[1])
        elif op == SPARSE:
            step, cut, length = args[1], args[2], args[3]
            kept = payload[length:].astype(np.int64)
            self.prefills[handle] = sparse_prefill_steps(
                self.model, mx.array(payload[:length]), kept, self.caches[handle], step, cut)
        elif op == NEXT:
            try:
                next(self.prefills[handle])
            except StopIteration:
                self.prefills.pop(handle)
        elif op == RELEASE:
            steps = self.prefills.pop(handle, None)
            if steps is not None:
                steps.close()
            self.caches.pop(handle, None)
        elif op == JOIN:
            mode, token, shift = args[1], args[2], args[3]
            cache = self.caches.pop(handle)
            if mode == JOIN_BATCH:
                if self.batch is None or not len(self.batch):
                    self.batch = DecodeBatch(self.model, self.group, follower=True)
                self.rows[handle] = _Row(handle)
                self.batch.add(self.rows[handle], cache, token, shift)
            elif mode == JOIN_SOLO:
                self.solo[handle] = SoloDecode(self.model, _Row(handle), cache, token, shift,
                                               self.group, follower=True)
        elif op == STEP:
            (self.batch if handle < 0 else self.solo[handle]).step()
        elif op == REMOVE:
            if handle >= 0:
                self.solo.pop(handle, None)
            else:
                self.batch.remove({self.rows.pop(int(h)) for h in payload})
        elif op == STORE:
            self._store(args, payload)
        elif op == CALIBRATE:
            from .policy import CostModel

            CostModel().calibrate(self.model, None, handle, 0)
        else:
            raise RuntimeError(f"unknown command {op} from rank 0")

    def _store(self, args: list, dropped: np.ndarray) -> None:
        source, handle, key, count = args[0], args[1], args[2], args[3]
        if key >= 0:
            if source == FROM_PREFILL:
                cache = self.caches[handle]
            elif source == FROM_SOLO:
                cache = self.solo[handle].cache
            else:
                cache = self.batch.extract(self.rows[handle])
            states = [(mx.contiguous(c.keys[..., :count, :]), mx.contiguous(c.values[..., :count, :]))
                      for c in cache]
            mx.eval(states)
            self.entries[key] = states
        for old in dropped.tolist():
            self.entries.pop(old, None)


class FollowerWorker:
    """A rank > 0's engine: a thread that loads the target's shard, runs the same
    probes as rank 0, then replays rank 0's commands until rank 0 shuts down.
    It takes no requests; `done` resolves when it ends."""

    def __init__(self, load: Callable[[], object], group, name: str = "specprefill-follower"):
        self._load = load
        self.group = group
        self.requests: dict = {}  # never any: requests are made on rank 0
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

    def stop(self) -> None:
        self.closed = True  # the loop ends on rank 0's word only

    def _main(self) -> None:
        model = None
        try:
            model = self._load()
            self.ready.set_result(None)
            Follower(self.group, model).serve()
            self.done.set_result(None)
        except BaseException as error:
            logger.exception("rank %d: follower failed", self.group.rank())
            self.failure = error
            for future in (self.ready, self.done):
                if not future.done():
                    future.set_exception(error)
        finally:
            del model
            mx.synchronize()
            mx.clear_cache()
            mx.clear_streams()
