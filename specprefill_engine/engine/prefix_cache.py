"""An LRU cache of KV prefixes, bounded in bytes, that knows each entry's positions.

An agent calls the model again and again with one growing prompt, so the previous
turn's KV (prompt and reply) can be reused and only what is new prefilled. An entry
holds the KV of a token sequence: every position (dense), or only the positions a
SpecPrefill request kept (sparse), each entry at its original position. A lookup
finds the entry sharing the longest prefix with the new prompt and hands back a
cache holding the entries before a cut the caller chooses, and their positions.
The same class serves the target and the draft.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache


def reusable(cache: list) -> bool:
    """Only plain KV caches can be cut to an arbitrary prefix."""
    return all(type(c) is KVCache for c in cache)


@dataclass
class Entry:
    tokens: np.ndarray  # the token sequence the entry stands for
    positions: Optional[np.ndarray]  # each stored KV entry's position; None: 0..len-1
    states: list  # per layer (keys, values), positions along axis 2
    nbytes: int
    key: int = -1  # names the entry in turn plans (and on the other ranks)
    keep: float = 1.0  # the share of the prompt its selection kept (1.0: dense)

    def dense_length(self) -> int:
        """How many leading positions are all present."""
        if self.positions is None:
            return self.tokens.size
        gaps = np.flatnonzero(self.positions != np.arange(self.positions.size))
        return int(gaps[0]) if gaps.size else int(self.positions.size)

    def count_before(self, position: int) -> int:
        if self.positions is None:
            return min(position, self.tokens.size)
        return int(np.searchsorted(self.positions, position))


@dataclass
class Hit:
    """The entry sharing the longest prefix with a prompt; `shared` tokens agree."""

    entry: Entry
    shared: int


class PrefixCache:
    """The index (rank 0 decides: `find`, `admit`) and the entries' KV (every rank
    keeps its own shard: `put`, `drop`), so a sharded engine's ranks hold the same
    entries under the same keys."""

    def __init__(self, max_bytes: int = 2 << 30):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()
        self.total_bytes = 0
        self._next_key = 0
        self.dropped: list[int] = []  # keys dropped by `admit`, for the plan to pass on

    def find(self, tokens: np.ndarray, dense_only: bool = False) -> Optional[Hit]:
        """The best entry for `tokens`: the longest usable shared prefix, leaving at
        least one token to prefill so the caller gets logits. `dense_only`: count
        only positions an entry holds without gaps (for a dense request)."""
        best, best_length = None, 0
        for key, entry in self.entries.items():
            n = min(entry.tokens.size, tokens.size - 1)
            if dense_only:
                n = min(n, entry.dense_length())
            if n <= best_length:
                continue
            mismatch = np.flatnonzero(entry.tokens[:n] != tokens[:n])
            length = int(mismatch[0]) if mismatch.size else n
            if length > best_length:
                best, best_length = key, length
        if best is None:
            return None
        self.entries.move_to_end(best)
        return Hit(self.entries[best], best_length)

    def admit(self, tokens: np.ndarray, nbytes: int, positions: Optional[np.ndarray] = None,
              keep: float = 1.0) -> Optional[int]:
        """Make room for an entry of `nbytes` (its KV comes with `put`); its key, or
        None when it is over the budget. Entries it makes redundant or evicts are
        dropped and their keys added to `dropped`."""
        if nbytes > self.max_bytes or tokens.size == 0:
            return None
        for key, entry in list(self.entries.items()):
            if entry.tokens.size <= tokens.size and entry.positions is None and \
                    positions is None and np.array_equal(entry.tokens, tokens[: entry.tokens.size]):
                self.drop(key)  # the new dense entry covers this one
        key = self._next_key
        self._next_key += 1
        self.entries[key] = Entry(tokens.copy(), positions, [], nbytes, key, keep)
        self.total_bytes += nbytes
        while self.total_bytes > self.max_bytes:
            self.drop(next(iter(self.entries)))
        return key

    def put(self, key: int, states: list) -> None:
        """The KV of an admitted entry (on a rank > 0: of an entry rank 0 admitted)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = Entry(np.zeros(0, np.int32), None, states,
                                              sum(k.nbytes + v.nbytes for k, v in states), key)
        entry.states = states

    def drop(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.total_bytes -= entry.nbytes
            self.dropped.append(key)

    def store(self, tokens: np.ndarray, cache: list) -> Optional[int]:
        """Admit and keep the first len(tokens) entries of a dense cache at once (the
        draft's cache, which lives on rank 0 alone)."""
        if not reusable(cache) or any(c.offset < tokens.size for c in cache):
            return None
        states = [(c.keys[..., : tokens.size, :], c.values[..., : tokens.size, :]) for c in cache]
        key = self.admit(tokens, sum(k.nbytes + v.nbytes for k, v in states))
        if key is not None:
            self.put(key, states)
        return key

    def clear(self) -> None:
        self.entries.clear()
        self.total_bytes = 0


def restore(model, states: Optional[list], count: int) -> list:
    """A fresh cache holding the first `count` entries of an entry's KV."""
    cache = make_prompt_cache(model)
    if states is None or count <= 0:
        return cache
    for layer, (keys, values) in zip(cache, states):
        layer.keys, layer.values = keys[..., :count, :], values[..., :count, :]
        layer.offset = count
    return cache
