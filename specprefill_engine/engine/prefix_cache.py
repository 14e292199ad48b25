"""An LRU cache of prompt prefixes for any mlx-lm cache, bounded in bytes.

An agent calls the model again and again with one growing prompt, so the previous
turn's cache (prompt and reply) can be reused and only what is new prefilled. An
entry stands for a token sequence and holds the cache entries it was fed: every
position (dense) or only those a SpecPrefill request kept (sparse, each entry at its
original position, listed in `positions` in the order they were fed: ascending, but
for a repaired view, whose added passages follow entries of later positions).

Plain `KVCache` layers are stored once and cut to any prefix at lookup. Every other
layer (conv/SSM states, sliding windows, `CacheList`, ...) cannot be cut, so it is
kept as checkpoints: its state at chosen prefix lengths, where a checkpoint at L is
the state after every entry at a position < L was fed and nothing else. A snapshot
holds references to the state arrays, not copies: MLX arrays are values, a cache's
later writes make new arrays (copying a buffer only while a snapshot still holds it).
Snapshots are rebuilt through mlx-lm's own `state` / `from_state`, as its
`save_prompt_cache` / `load_prompt_cache` do, so every cache class is served alike.
Stored KV is held as given, views included: a caller storing part of a live buffer it
will go on writing (a batch's) hands in a copy. The same class serves the target and
the draft.

Every decision is a function of the calls made, never of the rank: a sharded engine's
ranks make the same calls (`store`, `touch`, `drop`, `clear`; `find` changes nothing)
and hold the same entries under the same keys. `store` never evicts: the budget is kept
by dropping `evictions()`, which rank 0 decides with the entries a planned restore
still needs pinned, and every rank drops.

A disk tier (`disk_cache.py`, one process alone: never on a sharded target) may sit
under the cache: `persist` hands it an entry worth keeping (a turn's last store, an
entry about to be evicted), `promote` reads one back on a miss when reading is
predicted faster than prefilling what it adds. Memory stays the only place restores
read from.

One object serves both sides of the worker: the planner reads its index (`find`,
entries' tokens and positions) and the executor its tensors (`store`, `restore`,
`drop`), each entry holding both. Split in two, every store, merge and eviction would
have to be made twice and kept in step across ranks; one object changed only by the
calls above, in plan order, keeps them one fact. The executor resolves keys the plan
names that a store in the same plan merged away (`merged`, `resolve`).
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..core.prefill import cache_length

logger = logging.getLogger(__name__)
MAX_CHECKPOINTS = 16  # per entry; the longest are kept, the ones a next turn can use


def cuttable(layer) -> bool:
    """A plain KV cache can be cut to any prefix; other layers need checkpoints."""
    return type(layer) is KVCache


def reusable(cache: list) -> bool:
    """Every layer can be cut at any length: a prefix of any length is reusable."""
    return all(cuttable(c) for c in cache)


def supported(cache: list) -> bool:
    """Every layer can be cut or rebuilt from its `state`, so a PrefixCache serves it."""
    return all(cuttable(c) or hasattr(c, "from_state") for c in cache)


def checkpointed(model) -> bool:
    """Whether the model's cache has layers that cannot be cut, so that a prefix is
    reusable only where a snapshot was taken."""
    return not reusable(make_prompt_cache(model))


def prefix_cache_for(model, max_bytes: int, disk=None,
                     predict: Optional[Callable[[int, int], float]] = None
                     ) -> Optional["PrefixCache"]:
    """A prefix cache for `model`, or None when it has no budget or a cache layer that
    can neither be cut nor rebuilt; `disk` and `predict` as `PrefixCache` takes them."""
    if max_bytes and supported(make_prompt_cache(model)):
        return PrefixCache(max_bytes, disk=disk, predict=predict)
    return None


def _hold(tree):
    """New handles on the same buffers (no copy): a cache's slice assignment replaces
    the array behind its own handle, never behind these."""
    return tree_map(lambda x: x[...] if isinstance(x, mx.array) else x, tree)


def tree_nbytes(tree) -> int:
    return sum(x.nbytes for _, x in tree_flatten(tree) if isinstance(x, mx.array))


@dataclass
class Snapshot:
    """The layers that cannot be cut, as they stood when it was taken."""

    layers: dict  # layer index -> (cache class, held state)
    fed: Optional[int]  # entries the cache had taken
    nbytes: int


def _states(checkpoints: dict) -> list:
    return [state for s in checkpoints.values() for _, state in s.layers.values()]


def snapshot(cache: list) -> Snapshot:
    """The cache's uncuttable layers now, by reference: cheap enough to take at every
    point a later prompt may share (each chat message's end, the prompt's end)."""
    layers = {i: (type(c), _hold(c.state)) for i, c in enumerate(cache) if not cuttable(c)}
    return Snapshot(layers, cache_length(cache, None), tree_nbytes(list(layers.values())))


@dataclass
class Entry:
    tokens: np.ndarray  # the token sequence the entry stands for
    positions: Optional[np.ndarray]  # each stored entry's position; None: 0..len-1
    kv: list  # per layer: (keys, values) of every stored entry, or None (checkpointed)
    checkpoints: dict  # prefix length -> Snapshot, ascending
    key: int  # names the entry in turn plans
    nbytes: int = 0
    keep: float = 1.0  # the share of the prompt its selection kept (1.0: dense)
    densified: bool = False  # computed while idle from a SpecPrefill turn
    disk: Optional[str] = None  # its file in the disk tier (written, queued or read)
    from_disk: bool = False  # read back from the disk tier and not restored since

    @property
    def count(self) -> int:
        return self.tokens.size if self.positions is None else self.positions.size

    def dense_length(self) -> int:
        """How many leading positions are all present."""
        if self.positions is None:
            return self.tokens.size
        gaps = np.flatnonzero(self.positions != np.arange(self.positions.size))
        return int(gaps[0]) if gaps.size else int(self.positions.size)

    def count_before(self, position: int) -> int:
        """How many leading entries (in the order they were fed) are at positions before
        `position`: the entries a restore there keeps. A repaired view holds a passage
        fed after later positions; a cut before it stops at its first entry past the cut."""
        if self.positions is None:
            return min(position, self.tokens.size)
        past = np.flatnonzero(self.positions >= position)
        return int(past[0]) if past.size else int(self.positions.size)

    @property
    def cuts_anywhere(self) -> bool:
        return all(layer is not None for layer in self.kv)

    def restorable(self, limit: int) -> int:
        """The longest prefix of at most `limit` tokens a restore can start from."""
        limit = min(limit, self.tokens.size)
        if self.cuts_anywhere:
            return max(limit, 0)
        return max((length for length in self.checkpoints if length <= limit), default=0)

    def memory_bytes(self) -> int:
        return tree_nbytes(self.kv) + sum(s.nbytes for s in self.checkpoints.values())


@dataclass
class Hit:
    """The entry with the longest restorable prefix of a prompt: `shared` tokens agree,
    a restore can start at `cut` <= shared."""

    entry: Entry
    shared: int
    cut: int

    def describe(self, cut: Optional[int] = None) -> str:
        """What a restore at `cut` (default: the hit's) reuses, for the report."""
        cut = self.cut if cut is None else cut
        if cut <= 0:
            return "none"
        entry = self.entry
        if entry.cuts_anywhere:
            text = f"prefix of {cut} tokens" if cut == self.shared else \
                f"prefix of {cut} of {self.shared} shared tokens"
            if entry.densified and entry.positions is None:
                text = f"prefix (densified) of {text[len('prefix of '):]}"
        else:
            text = f"checkpoint at {cut} of {self.shared} shared tokens"
        if entry.positions is not None:
            text += f" ({entry.count_before(cut)} entries)"
        if entry.from_disk:
            text += " (disk)"
        return text


def best_hit(entries, tokens: np.ndarray, dense_only: bool = False) -> Optional[Hit]:
    """Of `entries` (oldest first: the newest wins a tie), the one a restore for
    `tokens` reuses most of (`PrefixCache.find`)."""
    best = None
    for entry in entries:
        n = min(entry.tokens.size, tokens.size - 1)
        if dense_only:
            n = min(n, entry.dense_length())
        if n <= 0 or (best is not None and entry.restorable(n) < best.cut):
            continue
        mismatch = np.flatnonzero(entry.tokens[:n] != tokens[:n])
        shared = int(mismatch[0]) if mismatch.size else n
        cut = entry.restorable(shared)
        if cut > 0 and (best is None or cut >= best.cut):
            best = Hit(entry, shared, cut)
    return best


def extends(long: Entry, short: Entry) -> bool:
    """`long` was fed `short`'s entries first and no other entry before short's end,
    so each of short's checkpoints holds for long."""
    n = short.tokens.size
    if long.tokens.size < n or not np.array_equal(long.tokens[:n], short.tokens):
        return False
    if long.positions is None and short.positions is None:
        return True
    count = short.count
    if long.count_before(n) != count:
        return False
    held = long.positions[:count] if long.positions is not None else np.arange(count)
    want = short.positions if short.positions is not None else np.arange(count)
    return bool(np.array_equal(held, want))


def _validated(tokens: np.ndarray, positions: Optional[np.ndarray], checkpoints: dict,
               cache: list) -> None:
    if positions is not None:
        if positions.ndim != 1 or positions.size > tokens.size or (positions.size and (
                positions.min() < 0 or positions.max() >= tokens.size
                or np.unique(positions).size != positions.size)):
            raise ValueError("positions must be distinct positions within tokens")
    probe = Entry(tokens, positions, [], {}, -1)
    layers = {i for i, c in enumerate(cache) if not cuttable(c)}
    for length, snap in checkpoints.items():
        if not 0 < length <= tokens.size:
            raise ValueError(f"checkpoints: length {length} is outside 1..{tokens.size}")
        if set(snap.layers) != layers:
            raise ValueError(f"checkpoints: the snapshot at {length} is of another model's cache")
        if snap.fed is not None and snap.fed != probe.count_before(length):
            raise ValueError(f"checkpoints: the snapshot at {length} was taken after "
                             f"{snap.fed} entries, not {probe.count_before(length)}")


class PrefixCache:
    """`disk`: a `disk_cache.DiskTier` under the memory (None: memory only);
    `predict(tokens, cached)`: the predicted seconds of prefilling `tokens` after
    `cached` entries (the policy's cost model), against which a read is weighed."""

    def __init__(self, max_bytes: int = 2 << 30, max_checkpoints: int = MAX_CHECKPOINTS,
                 disk=None, predict: Optional[Callable[[int, int], float]] = None):
        self.max_bytes = max_bytes
        self.max_checkpoints = max_checkpoints
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()
        self.total_bytes = 0
        self.next_key = 0  # keys are never reused; on every rank the same entry has one key
        self.merged: dict[int, int] = {}  # key -> the key of the entry that absorbed it
        self.disk = disk
        self.predict = predict

    def find(self, tokens: np.ndarray, dense_only: bool = False) -> Optional[Hit]:
        """The entry a restore for `tokens` reuses most of: the longest restorable
        prefix of the shared one, leaving at least one token to prefill so the caller
        gets logits. `dense_only`: count only positions an entry holds without gaps
        (for a dense request). None when nothing is restorable."""
        return best_hit(self.entries.values(), tokens, dense_only)

    def promote(self, tokens: np.ndarray, dense_only: bool = False) -> Optional[Hit]:
        """Consult the disk tier for `tokens` (as `find` does memory): read back the file
        that reaches further than memory's best when reading it is predicted faster than
        prefilling the entries it adds, and keep it in memory. The disk's hit when it was
        read, else None."""
        if self.disk is None:
            return None
        tokens = np.asarray(tokens)
        held = self.find(tokens, dense_only)
        hit = best_hit(self.disk.entries(), tokens, dense_only)
        base = held.cut if held is not None else 0
        if hit is None or hit.cut <= base or hit.entry.nbytes > self.max_bytes:
            return None
        entry, cached = hit.entry, held.entry.count_before(base) if held is not None else 0
        adds = entry.count_before(hit.cut) - cached
        prefill_s = self.predict(adds, cached) if self.predict is not None else float("inf")
        if not self.disk.pays(entry, prefill_s):
            return None
        loaded = self.disk.read(entry)
        if loaded is None:
            return None
        loaded.key, loaded.from_disk = self.next_key, True
        self.next_key += 1
        self.entries[loaded.key] = loaded
        self.total_bytes += loaded.nbytes
        return Hit(loaded, hit.shared, hit.cut)

    def persist(self, key: int) -> None:
        """Keep entry `key` on disk too (a turn's last store, an entry about to be
        evicted); nothing when there is no disk tier or the entry is there already."""
        entry = self.entries.get(self.resolve(key))
        if self.disk is not None and entry is not None and entry.disk is None:
            entry.disk = self.disk.write(entry)

    def resolve(self, key: int) -> int:
        """The key an entry now lives under (a newer entry may have absorbed it)."""
        while key in self.merged:
            key = self.merged[key]
        return key

    def touch(self, key: int) -> None:
        """An entry was used: it is the last to be evicted."""
        self.entries.move_to_end(key)
        self.entries[key].from_disk = False

    @staticmethod
    def restore(model, hit: Optional[Hit], cut: int) -> tuple[list, Optional[np.ndarray]]:
        """A fresh cache holding the hit's entries at positions < cut, and those
        positions (None when they are exactly 0..cut-1). `cut` must be restorable
        (`hit.cut`, or `hit.entry.restorable(limit)` for a shorter one)."""
        cache = make_prompt_cache(model)
        if hit is None or cut <= 0:
            return cache, None
        entry = hit.entry
        if entry.restorable(cut) != cut:
            raise ValueError(f"cut {cut} is not restorable from this entry (the longest "
                             f"at or before it is {entry.restorable(cut)})")
        count = entry.count_before(cut)
        for i, layer in enumerate(entry.kv):
            if layer is None:
                kind, state = entry.checkpoints[cut].layers[i]
                cache[i] = kind.from_state(_hold(state))
            elif count:
                keys, values = layer
                cache[i].keys, cache[i].values = keys[..., :count, :], values[..., :count, :]
                cache[i].offset = count
        positions = None if entry.positions is None else entry.positions[:count]
        if positions is not None and np.array_equal(positions, np.arange(count)):
            positions = None
        return cache, positions

    def store(self, tokens: np.ndarray, cache: list, positions: Optional[np.ndarray] = None,
              checkpoints: Optional[dict] = None, keep: float = 1.0,
              densified: bool = False) -> Optional[int]:
        """Keep a cache that was fed all of `tokens` (dense) or, with `positions`, one
        entry per listed position, plus `checkpoints` ({prefix length: snapshot}) taken
        on the way; the cache's own state is the checkpoint at len(tokens). An entry
        this one extends is merged into it (its checkpoints move over); one that
        extends this one takes this one's checkpoints instead. The size is known
        before anything is copied, so an entry over the budget is refused. Returns the
        key of the entry that now holds the tokens, None when refused."""
        tokens = np.array(tokens)
        positions = None if positions is None else np.array(positions)
        checkpoints = dict(checkpoints or {})
        _validated(tokens, positions, checkpoints, cache)
        new = Entry(tokens, positions, [], {}, -1, keep=keep, densified=densified)
        count, fed = new.count, cache_length(cache, None)
        if count == 0 or any(c.offset < count for c in cache if cuttable(c)):
            return None
        if reusable(cache):
            checkpoints = {}  # any length can be cut
        elif fed is None or fed == count:
            checkpoints[tokens.size] = snapshot(cache)
        elif not checkpoints:
            return None  # fed past the tokens and nothing to restore from
        new.kv = [(c.keys[..., :count, :], c.values[..., :count, :]) if cuttable(c) else None
                  for c in cache]

        for old in reversed(self.entries.values()):  # newest first
            if extends(old, new):  # already held: only the checkpoints are new
                return self._add_checkpoints(old, checkpoints)
        absorbed = [old for old in self.entries.values() if extends(new, old)]
        for old in absorbed:
            checkpoints = {**old.checkpoints, **checkpoints}
            new.densified |= old.densified  # its prefix came from a densified turn
        new.checkpoints = self._bounded(checkpoints)
        new.nbytes = new.memory_bytes()
        if new.nbytes > self.max_bytes:
            return None
        mx.eval(new.kv, _states(new.checkpoints))  # a failed copy fails here, changing nothing
        new.key = self.next_key
        self.next_key += 1
        for old in absorbed:
            self.drop(old.key)
            self.merged[old.key] = new.key
        self.entries[new.key] = new
        self.total_bytes += new.nbytes
        return new.key

    def _bounded(self, checkpoints: dict) -> dict:
        lengths = sorted(checkpoints)[-self.max_checkpoints:]
        return {length: checkpoints[length] for length in lengths}

    def _add_checkpoints(self, entry: Entry, checkpoints: dict) -> Optional[int]:
        merged = self._bounded({**checkpoints, **entry.checkpoints})
        size = entry.nbytes - sum(s.nbytes for s in entry.checkpoints.values()) + \
            sum(s.nbytes for s in merged.values())
        if size > self.max_bytes:
            return None
        mx.eval(_states(merged))
        entry.checkpoints = merged
        entry.disk = None  # changed: a later `persist` writes it anew
        self.total_bytes += size - entry.nbytes
        entry.nbytes = size
        self.entries.move_to_end(entry.key)
        return entry.key

    def evictions(self, pinned=()) -> list[int]:
        """The least recently used entries to drop to be within the budget again,
        never one in `pinned`."""
        excess, keys = self.total_bytes - self.max_bytes, []
        for key, entry in self.entries.items():
            if excess <= 0:
                break
            if key not in pinned:
                keys.append(key)
                excess -= entry.nbytes
        return keys

    def drop(self, key: int) -> None:
        entry = self.entries.pop(key, None)  # already merged into a newer one: nothing to do
        if entry is not None:
            self.total_bytes -= entry.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.merged.clear()
        self.total_bytes = 0
