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
    key: int = -1  # names the entry to the other ranks of a distributed engine

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
    def __init__(self, max_bytes: int = 2 << 30):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()
        self.total_bytes = 0
        self._next_key = 0
        self.track = False  # record dropped keys (for the other ranks' copies)
        self.dropped: list[int] = []

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

    @staticmethod
    def restore(model, hit: Optional[Hit], cut: int) -> tuple[list, Optional[np.ndarray]]:
        """A fresh cache holding the hit's entries at positions < cut, and those
        positions (None when they are exactly 0..cut-1)."""
        cache = make_prompt_cache(model)
        if hit is None or cut <= 0:
            return cache, None
        entry = hit.entry
        count = entry.count_before(cut)
        for layer, (keys, values) in zip(cache, entry.states):
            layer.keys, layer.values = keys[..., :count, :], values[..., :count, :]
            layer.offset = count
        positions = None if entry.positions is None else entry.positions[:count]
        if positions is not None and np.array_equal(positions, np.arange(count)):
            positions = None
        return cache, positions

    def store(self, tokens: np.ndarray, cache: list,
              positions: Optional[np.ndarray] = None) -> Optional[int]:
        """Keep a cache's first entries: all of `tokens` (dense) or, with `positions`,
        one entry per listed position. The size is known from the shapes, so an
        entry over the budget is refused before anything is copied. Returns the new
        entry's key, None when refused."""
        count = tokens.size if positions is None else positions.size
        if not reusable(cache) or count == 0 or any(c.offset < count for c in cache):
            return None
        states = [(c.keys[..., :count, :], c.values[..., :count, :]) for c in cache]
        size = sum(k.nbytes + v.nbytes for k, v in states)
        if size > self.max_bytes:
            return None
        states = [(mx.contiguous(k), mx.contiguous(v)) for k, v in states]
        mx.eval(states)
        for key, entry in list(self.entries.items()):
            if entry.tokens.size <= tokens.size and entry.positions is None and \
                    positions is None and np.array_equal(entry.tokens, tokens[: entry.tokens.size]):
                self._drop(key)  # the new dense entry covers this one
        key = self._next_key
        self.entries[key] = Entry(tokens.copy(), positions, states, size, key)
        self._next_key += 1
        self.total_bytes += size
        while self.total_bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
        return key

    def _drop(self, key: int) -> None:
        self.total_bytes -= self.entries.pop(key).nbytes
        if self.track:
            self.dropped.append(key)

    def clear(self) -> None:
        self.entries.clear()
        self.total_bytes = 0
