"""A turn of the worker as data: what the models compute in it.

The worker (rank 0) decides each turn's `TurnPlan` from the requests' states; the
executor (`executor.py`) runs it, the same on one process or on every rank of a sharded
target, which receives its target work from rank 0 (`encode_plan` / `decode_plan`,
broadcast by `distributed.py`). The draft's scoring units are rank 0's alone and do not
travel.

Order of a turn (the executor's): disk writes and reads of prefix-cache entries (rank 0
alone), stores, drops, releases, demotions, joins, one decode step, restores, prefill
chunks (the last of a prompt samples its first token), then a unit of the draft's
scoring. Prefix-cache entries are named by the keys the planner's index
(`prefix_cache.py`) gave them; a store carries what it does to them. Rows that ended in the last turn are stored and leave before the
step; a request's prefill chunks run after it, so its first token comes in the turn of
its last chunk and it joins the batch in the next.

`Feed` is what a model is to compute, and how far it got: a request's prefill, a
densify job's, the draft's share of scoring. Its `unit` gives a turn's chunks.
"""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class Store:
    """Keep a request's cache for `tokens` (its prompt and the reply fed so far): every
    position, or with `positions` the kept ones; with the checkpoints taken on the way.
    As prefix-cache entry `key`, absorbing the entries `absorbs` (their checkpoints move
    over), or with `into`, adding only checkpoints to entry `key`, which holds it already
    (`PrefixIndex.plan_store` decides)."""

    handle: int
    tokens: np.ndarray
    positions: Optional[np.ndarray] = None
    keep: float = 1.0  # the share its selection kept (1.0: dense)
    densified: bool = False  # the dense KV of a SpecPrefill turn, computed while idle
    key: int = -1
    into: bool = False
    absorbs: list = field(default_factory=list)
    prompt: int = 0  # the length of the turn's prompt, its reply after it (0: all prompt)


@dataclass
class Restore:
    """Start a request's cache: empty (key -1), or prefix-cache entry `key`'s `count`
    entries before position `cut` (a restorable cut: `Entry.restorable`), at `positions`
    (None: 0..count-1)."""

    handle: int
    key: int = -1
    cut: int = 0
    count: int = 0
    positions: Optional[np.ndarray] = None


@dataclass
class Load:
    """Read prefix-cache entry `key` back from its disk tier's file (`stub`: the file's
    index entry); of the draft's cache with `draft`. Rank 0 alone."""

    key: int
    stub: object
    draft: bool = False


@dataclass
class Persist:
    """Write prefix-cache entry `entry` (the index's) to its disk tier; of the draft's
    cache with `draft`. Rank 0 alone."""

    entry: object
    draft: bool = False


@dataclass
class PrefillChunk:
    """One forward over part of a request's prompt. `positions`: each token's true
    position (SpecPrefill); None: they follow the cache. `last`: the prompt's last
    chunk, whose last logits give the first token (sampled on rank 0)."""

    handle: int
    tokens: np.ndarray
    positions: Optional[np.ndarray] = None
    last: bool = False
    checkpoint: int = 0  # > 0: snapshot the cache after it, as the prefix of this length


@dataclass
class Join:
    """A request whose first token (sampled on rank 0) is known starts decoding at
    position `length` (its prompt's: a SpecPrefill row's cache holds fewer entries)."""

    handle: int
    token: int
    length: int
    solo: bool = False  # decodes on its own (a model whose caches cannot batch)
    speculative: int = 0  # > 0: decodes alone, its draft proposing this many tokens a round


@dataclass
class ScoreUnit:
    """One unit of a request's scoring by the draft (rank 0 alone), for a prompt of
    `length` tokens: `tokens` of it through the draft, after `restore` (the first unit:
    the draft's cache from its prefix cache) or what came before; the prompt's last
    chunk `captures` the window's queries; a `lookahead` step adds a query; `echoes`:
    `tokens` are the question's, forwarded after the prompt for their queries; the `reduce`
    unit turns the queries into the importance (`tokens`: the whole prompt, kept with
    the draft's cache in its prefix cache as `store` says, and kept for speculative
    decoding when `keep_for_decode`). A draft that only computes the prompt's KV (a
    dense request that will decode speculatively) captures nothing: its `reduce` unit
    gives no importance."""

    handle: int
    length: int
    tokens: Optional[np.ndarray] = None
    restore: Optional[Restore] = None
    captures: bool = False
    lookahead: bool = False
    echoes: bool = False
    reduce: bool = False
    store: Optional[Store] = None
    keep_for_decode: bool = False


@dataclass(eq=False)
class Feed:
    """Tokens a model computes: after `restore` (`cached` entries), `tokens` at
    `positions` (each token's true position; None: consecutive after the cached
    entries), in chunks ending at `chunk_ends` ((end, pause): a turn may end after a
    pause); `checkpoints`: chunk end -> the prompt length a snapshot there stands for;
    `fed`: how many are planned (a failure ends the work)."""

    restore: Restore
    tokens: np.ndarray
    positions: Optional[np.ndarray] = None
    cached: int = 0
    chunk_ends: list = field(default_factory=list)
    checkpoints: dict = field(default_factory=dict)
    fed: int = 0

    @property
    def done(self) -> bool:
        return self.fed == self.tokens.size

    def take_unit(self, prompt_length: int = 0) -> list:
        """The chunks of one turn from `fed` on, counted as fed: up to the first pause, or
        the feed's end (the `last` chunk when `prompt_length`: it samples the first token
        and snapshots the cache as that prefix)."""
        chunks = []
        for end, pause in self.chunk_ends:
            if end <= self.fed:
                continue
            last = end == self.tokens.size
            checkpoint = prompt_length if last else self.checkpoints.get(end, 0)
            chunks.append(PrefillChunk(
                self.restore.handle, self.tokens[self.fed:end],
                None if self.positions is None else self.positions[self.fed:end],
                last=last and prompt_length > 0, checkpoint=checkpoint))
            self.fed = end
            if pause or last:
                break
        return chunks

    def add_unit(self, plan: "TurnPlan", prompt_length: int = 0) -> None:
        """This turn's chunks into `plan`, after the restore when they are the first."""
        if self.fed == 0:
            plan.restores.append(self.restore)
        plan.chunks += self.take_unit(prompt_length)


@dataclass
class TurnPlan:
    persists: list = field(default_factory=list)  # Persist (rank 0)
    loads: list = field(default_factory=list)  # Load (rank 0)
    stores: list = field(default_factory=list)
    drops: list = field(default_factory=list)  # prefix-cache keys to forget (the budget)
    releases: list = field(default_factory=list)  # handles whose target work ends
    joins: list = field(default_factory=list)
    demotions: list = field(default_factory=list)  # speculative rows into the batch (rank 0)
    decode: bool = False
    restores: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    scoring: list = field(default_factory=list)  # ScoreUnits (rank 0 alone)
    draft_drops: list = field(default_factory=list)  # draft prefix-cache keys (rank 0)
    shutdown: bool = False

    def targets(self) -> bool:
        """Whether the plan holds target work (what the other ranks must run)."""
        return bool(self.stores or self.drops or self.releases or self.joins or self.demotions
                    or self.decode or self.restores or self.chunks or self.shutdown)

    def __bool__(self) -> bool:
        return self.targets() or bool(self.scoring or self.draft_drops or self.loads
                                      or self.persists)


# encoding for the broadcast: one int32 array, an op code then its fields ------------

_STORE, _DROP, _RELEASE, _JOIN, _DECODE, _RESTORE, _CHUNK, _SHUTDOWN = range(1, 9)
KEEP_SCALE = 1_000_000  # keep travels as an integer share


def _array(values: list, i: int, n: int, dtype) -> np.ndarray:
    return np.asarray(values[i : i + n], dtype=dtype)


def encode_plan(plan: TurnPlan) -> np.ndarray:
    """The plan's target work as one int32 array (the draft's stays on rank 0)."""
    out: list = []
    for store in plan.stores:
        positions = [] if store.positions is None else store.positions.tolist()
        flags = int(store.positions is not None) | int(store.densified) << 1 | \
            int(store.into) << 2
        out += [_STORE, store.handle, round(store.keep * KEEP_SCALE), store.tokens.size,
                len(positions), flags, store.key, len(store.absorbs), *store.absorbs,
                *store.tokens.tolist(), *positions]
    for key in plan.drops:
        out += [_DROP, key]
    for handle in plan.releases:
        out += [_RELEASE, handle]
    for join in plan.joins:
        out += [_JOIN, join.handle, join.token, join.length, int(join.solo)]
    if plan.decode:
        out += [_DECODE]
    for restore in plan.restores:
        positions = [] if restore.positions is None else restore.positions.tolist()
        out += [_RESTORE, restore.handle, restore.key, restore.cut, restore.count,
                int(restore.positions is not None), len(positions), *positions]
    for chunk in plan.chunks:
        n = int(chunk.tokens.size)
        flags = int(chunk.last) | int(chunk.positions is not None) << 1
        out += [_CHUNK, chunk.handle, flags, chunk.checkpoint, n, *chunk.tokens.tolist()]
        if chunk.positions is not None:
            out += chunk.positions.tolist()
    if plan.shutdown:
        out += [_SHUTDOWN]
    return np.asarray(out, dtype=np.int32)


def decode_plan(values: np.ndarray) -> TurnPlan:
    plan, values, i = TurnPlan(), values.tolist(), 0
    while i < len(values):
        op = values[i]
        if op == _STORE:
            handle, keep, n, m, flags, key, a = values[i + 1 : i + 8]
            absorbs = values[i + 8 : i + 8 + a]
            i += 8 + a
            tokens = _array(values, i, n, np.int32)
            positions = _array(values, i + n, m, np.int64) if flags & 1 else None
            plan.stores.append(Store(handle, tokens, positions, keep / KEEP_SCALE,
                                     bool(flags & 2), key, bool(flags & 4), absorbs))
            i += n + m
        elif op == _DROP:
            plan.drops.append(values[i + 1])
            i += 2
        elif op == _RELEASE:
            plan.releases.append(values[i + 1])
            i += 2
        elif op == _JOIN:
            handle, token, length, solo = values[i + 1 : i + 5]
            plan.joins.append(Join(handle, token, length, bool(solo)))
            i += 5
        elif op == _DECODE:
            plan.decode = True
            i += 1
        elif op == _RESTORE:
            handle, key, cut, count, sparse, m = values[i + 1 : i + 7]
            positions = _array(values, i + 7, m, np.int64) if sparse else None
            plan.restores.append(Restore(handle, key, cut, count, positions))
            i += 7 + m
        elif op == _CHUNK:
            handle, flags, checkpoint, n = values[i + 1 : i + 5]
            i += 5
            tokens = _array(values, i, n, np.int32)
            i += n
            positions = None
            if flags & 2:
                positions = _array(values, i, n, np.int64)
                i += n
            plan.chunks.append(PrefillChunk(handle, tokens, positions, bool(flags & 1), checkpoint))
        elif op == _SHUTDOWN:
            plan.shutdown = True
            i += 1
        else:
            raise ValueError(f"unknown plan op {op} at {i}")
    return plan
