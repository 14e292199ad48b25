"""A turn of the worker as data: what the target computes in it, on every rank.

The scheduler (rank 0) decides each turn's `TurnPlan` from the requests' states; the
executor (`executor.py`) runs it, the same on one process or on every rank of a sharded
target, which receives it from rank 0 (`encode` / `decode`, broadcast by
`distributed.py`). A plan holds target work only; the draft's scoring runs on rank 0
alone and is not part of it.

Order of a turn (the executor's): stores, drops, releases, joins, one decode step,
restores, prefill chunks. Rows that ended in the last turn are stored and leave before
the step; a request's prefill chunks run after it, so its first token comes in the turn
of its last chunk and it joins the batch in the next.
"""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class Store:
    """Keep a request's cache for `tokens` (its prompt and the reply fed so far): every
    position, or with `positions` the kept ones; with the checkpoints taken on the way."""

    handle: int
    tokens: np.ndarray
    positions: Optional[np.ndarray] = None
    keep: float = 1.0  # the share its selection kept (1.0: dense)
    densified: bool = False  # the dense KV of a SpecPrefill turn, computed while idle


@dataclass
class Restore:
    """Start a request's target cache: empty (key -1), or prefix-cache entry `key`'s
    entries before position `cut` (a restorable cut: `Entry.restorable`)."""

    handle: int
    key: int = -1
    cut: int = 0


@dataclass
class Chunk:
    """One forward over part of a request's prompt. `positions`: each token's true
    position (SpecPrefill); None: they follow the cache. `last`: the prompt's last
    chunk, whose last logits give the first token."""

    handle: int
    tokens: np.ndarray
    positions: Optional[np.ndarray] = None
    last: bool = False
    checkpoint: int = 0  # > 0: snapshot the cache after it, as the prefix of this length


@dataclass
class Join:
    """A request whose first token (sampled on rank 0) is known starts decoding:
    `shift` moves its decode positions (SpecPrefill: M - cache entries)."""

    handle: int
    token: int
    shift: int = 0
    solo: bool = False  # decodes on its own (a model whose caches cannot batch)


@dataclass
class TurnPlan:
    stores: list = field(default_factory=list)
    drops: list = field(default_factory=list)  # prefix-cache keys to forget (the budget)
    releases: list = field(default_factory=list)  # handles whose target work ends
    joins: list = field(default_factory=list)
    decode: bool = False
    restores: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    shutdown: bool = False

    def __bool__(self) -> bool:
        return bool(self.stores or self.drops or self.releases or self.joins or self.decode
                    or self.restores or self.chunks or self.shutdown)


# encoding for the broadcast: one int32 array, an op code then its fields ------------

_STORE, _DROP, _RELEASE, _JOIN, _DECODE, _RESTORE, _CHUNK, _SHUTDOWN = range(1, 9)
KEEP_SCALE = 1_000_000  # keep travels as an integer share


def _array(values: list, i: int, n: int, dtype) -> np.ndarray:
    return np.asarray(values[i : i + n], dtype=dtype)


def encode(plan: TurnPlan) -> np.ndarray:
    out: list = []
    for store in plan.stores:
        positions = [] if store.positions is None else store.positions.tolist()
        flags = int(store.positions is not None) | int(store.densified) << 1
        out += [_STORE, store.handle, round(store.keep * KEEP_SCALE), store.tokens.size,
                len(positions), flags, *store.tokens.tolist(), *positions]
    for key in plan.drops:
        out += [_DROP, key]
    for handle in plan.releases:
        out += [_RELEASE, handle]
    for join in plan.joins:
        out += [_JOIN, join.handle, join.token, join.shift, int(join.solo)]
    if plan.decode:
        out += [_DECODE]
    for restore in plan.restores:
        out += [_RESTORE, restore.handle, restore.key, restore.cut]
    for chunk in plan.chunks:
        n = int(chunk.tokens.size)
        flags = int(chunk.last) | int(chunk.positions is not None) << 1
        out += [_CHUNK, chunk.handle, flags, chunk.checkpoint, n, *chunk.tokens.tolist()]
        if chunk.positions is not None:
            out += chunk.positions.tolist()
    if plan.shutdown:
        out += [_SHUTDOWN]
    return np.asarray(out, dtype=np.int32)


def decode(values: np.ndarray) -> TurnPlan:
    plan, values, i = TurnPlan(), values.tolist(), 0
    while i < len(values):
        op = values[i]
        if op == _STORE:
            handle, keep, n, m, flags = values[i + 1 : i + 6]
            i += 6
            tokens = _array(values, i, n, np.int32)
            positions = _array(values, i + n, m, np.int64) if flags & 1 else None
            plan.stores.append(Store(handle, tokens, positions, keep / KEEP_SCALE,
                                     bool(flags & 2)))
            i += n + m
        elif op == _DROP:
            plan.drops.append(values[i + 1])
            i += 2
        elif op == _RELEASE:
            plan.releases.append(values[i + 1])
            i += 2
        elif op == _JOIN:
            handle, token, shift, solo = values[i + 1 : i + 5]
            plan.joins.append(Join(handle, token, shift, bool(solo)))
            i += 5
        elif op == _DECODE:
            plan.decode = True
            i += 1
        elif op == _RESTORE:
            plan.restores.append(Restore(*values[i + 1 : i + 4]))
            i += 4
        elif op == _CHUNK:
            handle, flags, checkpoint, n = values[i + 1 : i + 5]
            i += 5
            tokens = _array(values, i, n, np.int32)
            i += n
            positions = None
            if flags & 2:
                positions = _array(values, i, n, np.int64)
                i += n
            plan.chunks.append(Chunk(handle, tokens, positions, bool(flags & 1), checkpoint))
        elif op == _SHUTDOWN:
            plan.shutdown = True
            i += 1
        else:
            raise ValueError(f"unknown plan op {op} at {i}")
    return plan
