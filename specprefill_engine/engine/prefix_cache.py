"""The prefix cache's index: which token sequences are cached, and every decision on them.

An agent calls the model again and again with one growing prompt, so the previous
turn's cache (prompt and reply) can be reused and only what is new prefilled. An
entry stands for a token sequence and the cache entries it was fed: every position
(dense) or only those a SpecPrefill request kept (sparse, each entry at its original
position, listed in `positions` in the order they were fed: ascending, but for a
repaired view, whose added passages follow entries of later positions). Its tensors
are the executor's (`kv_store.py`), under the key this index gives it.

The planner owns the index, on rank 0 alone: lookups (`find`), the least recently
used order (`touch`), the budget (`evictions`), and what a store does (`plan_store`:
its key, the entries it absorbs, or the entry it only adds checkpoints to), decided
when the store is planned, so the plan carries every decision and each rank's
executor only follows it. The index takes a store's outcome (`commit`: the
checkpoints kept and the bytes, or a refusal) after the turn that ran it.

A disk tier (`disk_cache.py`, one process alone: never on a sharded target) may sit
under the cache: `persist` plans writing an entry worth keeping there (a turn's last
store, an entry about to be evicted), `promote` plans reading one back on a miss when
reading is predicted faster than prefilling what it adds. Memory stays the only place
restores read from.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .kv_store import checkpointed, count_before, serves
from .plan import Load, Persist, Restore, Store


@dataclass
class Entry:
    tokens: np.ndarray  # the token sequence the entry stands for
    positions: Optional[np.ndarray]  # each stored entry's position; None: 0..len-1
    cuts_anywhere: bool  # every layer is plain KV: any prefix restores, else checkpoints only
    checkpoints: tuple = ()  # prefix lengths a checkpoint is held at, ascending
    key: int = -1  # names the entry in turn plans
    nbytes: int = 0
    keep: float = 1.0  # the share of the prompt its selection kept (1.0: dense)
    densified: bool = False  # computed while idle from a SpecPrefill turn
    disk: Optional[str] = None  # its file in the disk tier (written, queued or read)
    from_disk: bool = False  # read back from the disk tier and not restored since
    writing: bool = False  # a planned write has not run yet
    prompt: int = 0  # the stored turn's prompt length, its reply after it (0: all prompt)

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
        """How many leading entries are at positions before `position` (`kv_store`)."""
        return count_before(self.positions, self.tokens.size, position)

    def held_before(self, cut: int) -> Optional[np.ndarray]:
        """The positions of the entries a restore at `cut` keeps; None when they are
        exactly 0..n-1."""
        count = self.count_before(cut)
        if self.positions is None or np.array_equal(self.positions[:count], np.arange(count)):
            return None
        return self.positions[:count]

    def restorable(self, limit: int) -> int:
        """The longest prefix of at most `limit` tokens a restore can start from."""
        limit = min(limit, self.tokens.size)
        if self.cuts_anywhere:
            return max(limit, 0)
        return max((length for length in self.checkpoints if length <= limit), default=0)


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
    `tokens` reuses most of (`PrefixIndex.find`)."""
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


def prefix_cache_for(model, max_bytes: int, disk=None,
                     predict: Optional[Callable[[int, int], float]] = None
                     ) -> Optional["PrefixIndex"]:
    """The index of a prefix cache for `model`, or None when it has no budget or a cache
    layer that can neither be cut nor rebuilt; `disk` and `predict` as `PrefixIndex`
    takes them. Its tensors go in a `kv_store.KVStore` of the same budget."""
    if serves(model, max_bytes):
        return PrefixIndex(max_bytes, not checkpointed(model), disk, predict)
    return None


class PrefixIndex:
    """The index of one model's prefix cache, within `max_bytes` (`evictions`).
    `disk`: a `disk_cache.DiskTier` under the memory (None: memory only);
    `predict(tokens, cached)`: the predicted seconds of prefilling `tokens` after
    `cached` entries (the policy's cost model), against which a read is weighed."""

    def __init__(self, max_bytes: int = 2 << 30, cuts_anywhere: bool = True, disk=None,
                 predict: Optional[Callable[[int, int], float]] = None):
        self.max_bytes = max_bytes
        self.cuts_anywhere = cuts_anywhere  # the model's cache: all plain KV
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()
        self.planned: dict[int, Entry] = {}  # key -> an entry a planned store or load makes
        self.total_bytes = 0
        self.next_key = 0  # keys are never reused
        self.disk = disk
        self.predict = predict

    def find(self, tokens: np.ndarray, dense_only: bool = False) -> Optional[Hit]:
        """The entry a restore for `tokens` reuses most of: the longest restorable
        prefix of the shared one, leaving at least one token to prefill so the caller
        gets logits. `dense_only`: count only positions an entry holds without gaps
        (for a dense request). None when nothing is restorable."""
        return best_hit(self.entries.values(), tokens, dense_only)

    def _key(self) -> int:
        key, self.next_key = self.next_key, self.next_key + 1
        return key

    def plan_store(self, store: Store, pinned=()) -> None:
        """Decide what keeping `store` does, in its fields: an entry that extends it
        already holds it (only checkpoints are new: `into`), else a new key that absorbs
        the entries it extends (their checkpoints move over), never one in `pinned` (a
        planned restore still names it). Stores planned before it in the same plan count."""
        new = Entry(np.asarray(store.tokens), store.positions, self.cuts_anywhere,
                    keep=store.keep, densified=store.densified, prompt=store.prompt)
        known = [*self.entries.values(), *self.planned.values()]
        for old in reversed(known):  # newest first
            if extends(old, new):
                store.key, store.into = old.key, True
                return
        absorbed = [old for old in known if old.key not in pinned and extends(new, old)]
        new.densified |= any(old.densified for old in absorbed)  # its prefix came densified
        store.key, store.absorbs = self._key(), [old.key for old in absorbed]
        new.key = store.key
        self.planned[new.key] = new

    def commit(self, store: Store, checkpoints: Optional[tuple], nbytes: int = 0) -> None:
        """A planned store ran: the checkpoint lengths it kept and its bytes, or None
        when it was refused (nothing changed then)."""
        new = self.planned.pop(store.key, None)
        if checkpoints is None:
            return
        entry = self.entries.get(store.key) if store.into else new
        if entry is None:
            return
        if not store.into:
            for key in store.absorbs:
                self.drop(key)
            self.entries[entry.key] = entry
        else:
            self.total_bytes -= entry.nbytes
            entry.disk = None  # changed: a later persist writes it anew
            self.entries.move_to_end(entry.key)
        entry.checkpoints, entry.nbytes = tuple(checkpoints), nbytes
        self.total_bytes += nbytes

    def promote(self, tokens: np.ndarray, dense_only: bool = False) -> Optional[Load]:
        """Consult the disk tier for `tokens` (as `find` does memory): a `Load` of the
        file that reaches further than memory's best when reading it is predicted faster
        than prefilling the entries it adds; None otherwise."""
        if self.disk is None:
            return None
        tokens = np.asarray(tokens)
        held = best_hit([*self.entries.values(), *self.planned.values()], tokens, dense_only)
        hit = best_hit(self.disk.entries(), tokens, dense_only)
        base = held.cut if held is not None else 0
        if hit is None or hit.cut <= base or hit.entry.nbytes > self.max_bytes:
            return None
        stub, cached = hit.entry, held.entry.count_before(base) if held is not None else 0
        adds = stub.count_before(hit.cut) - cached
        prefill_s = self.predict(adds, cached) if self.predict is not None else float("inf")
        if not self.disk.pays(stub, prefill_s):
            return None
        entry = Entry(stub.tokens, stub.positions, stub.cuts_anywhere, stub.checkpoints,
                      self._key(), stub.nbytes, stub.keep, stub.densified, stub.disk, True,
                      prompt=stub.prompt)
        self.planned[entry.key] = entry
        return Load(entry.key, stub)

    def loaded(self, key: int, nbytes: Optional[int]) -> None:
        """A planned load ran: the entry's bytes in memory, or None when the file could
        not be read."""
        entry = self.planned.pop(key, None)
        if entry is not None and nbytes is not None:
            entry.nbytes = nbytes
            self.entries[key] = entry
            self.total_bytes += nbytes

    def persist(self, key: int) -> Optional[Persist]:
        """A `Persist` of entry `key` to the disk tier, when there is one and the entry
        is neither there already nor planned to be written."""
        entry = self.entries.get(key)
        if self.disk is None or entry is None or entry.disk is not None or entry.writing:
            return None
        entry.writing = True
        return Persist(entry)

    @staticmethod
    def persisted(persist: Persist, name: Optional[str]) -> None:
        """A planned write ran: its file's name, or None when the tier did not take it."""
        persist.entry.writing = False
        if name is not None:
            persist.entry.disk = name

    def touch(self, key: int) -> None:
        """An entry is used (a restore is planned): it is the last to be evicted."""
        if key in self.entries:
            self.entries.move_to_end(key)
            self.entries[key].from_disk = False

    def evictions(self, pinned=(), limit: Optional[int] = None) -> list[int]:
        """The least recently used entries to drop to be within the budget again (and
        within `limit` bytes: what the engine's memory budget leaves the cache), never
        one in `pinned`."""
        bound = self.max_bytes if limit is None else min(self.max_bytes, limit)
        excess, keys = self.total_bytes - bound, []
        for key, entry in self.entries.items():
            if excess <= 0:
                break
            if key not in pinned:
                keys.append(key)
                excess -= entry.nbytes
        return keys

    def pinned_bytes(self, pinned) -> int:
        """Bytes of the entries in `pinned`: what the cache cannot give back now."""
        return sum(self.entries[key].nbytes for key in pinned if key in self.entries)

    def drop(self, key: int) -> None:
        entry = self.entries.pop(key, None)  # already absorbed or dropped: nothing to do
        if entry is not None:
            self.total_bytes -= entry.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.planned.clear()
        self.total_bytes = 0


@dataclass
class PrefixIndexes:
    """The indexes of the target's prefix cache (dense and sparse entries) and of the
    draft's."""

    target: Optional[PrefixIndex] = None
    draft: Optional[PrefixIndex] = None


def restore_of(handle: int, hit: Optional[Hit], cut: int) -> Restore:
    """Restore `hit`'s entries before position `cut` for `handle` (nothing without a hit
    or a cut)."""
    if hit is None or cut <= 0:
        return Restore(handle)
    entry = hit.entry
    return Restore(handle, entry.key, cut, entry.count_before(cut), entry.held_before(cut))
