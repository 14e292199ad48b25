"""An LRU cache of DENSE prompt prefixes, bounded in bytes.

A chat that grows turn by turn starts each prompt with the previous one, so the
previous prompt's KV can be reused and only the new suffix prefilled. Only dense KV
is stored: a sparse prefill's cache lacks the dropped tokens and would give a later
request a different answer. Lookup finds the entry sharing the longest prefix with
the new prompt (entries are few, so a scan with numpy is cheap) and trims a copy.
"""

from collections import OrderedDict
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache


def reusable(cache: list) -> bool:
    """Only plain KV caches can be trimmed to an arbitrary prefix."""
    return all(type(c) is KVCache for c in cache)


class PrefixCache:
    def __init__(self, max_bytes: int = 2 << 30):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[int, tuple[np.ndarray, list, int]]" = OrderedDict()
        self.total_bytes = 0
        self._next_key = 0

    def lookup(self, model, tokens: np.ndarray) -> tuple[list, int]:
        """A fresh cache holding the longest stored prefix of `tokens`, and its length.

        At least one token is always left to prefill, so the caller gets logits.
        """
        best_key, best_length = None, 0
        for key, (stored, _, _) in self.entries.items():
            n = min(stored.size, tokens.size - 1)
            if n <= best_length:
                continue
            mismatch = np.flatnonzero(stored[:n] != tokens[:n])
            length = int(mismatch[0]) if mismatch.size else n
            if length > best_length:
                best_key, best_length = key, length
        cache = make_prompt_cache(model)
        if best_key is None:
            return cache, 0
        self.entries.move_to_end(best_key)
        _, states, _ = self.entries[best_key]
        for layer, (keys, values) in zip(cache, states):
            layer.keys, layer.values = keys[..., :best_length, :], values[..., :best_length, :]
            layer.offset = best_length
        return cache, best_length

    def store(self, tokens: np.ndarray, cache: list) -> None:
        """Keep the first len(tokens) positions of a dense cache.

        The size is known from the shapes, so an entry over the budget is refused
        before anything is copied."""
        if not reusable(cache) or tokens.size == 0:
            return
        length = tokens.size
        states = [(c.keys[..., :length, :], c.values[..., :length, :]) for c in cache]
        size = sum(k.nbytes + v.nbytes for k, v in states)
        if size > self.max_bytes:
            return
        states = [(mx.contiguous(k), mx.contiguous(v)) for k, v in states]
        mx.eval(states)
        for key, (stored, _, _) in list(self.entries.items()):
            if stored.size <= length and np.array_equal(stored, tokens[: stored.size]):
                self._drop(key)  # the new entry covers this one
        self.entries[self._next_key] = (tokens.copy(), states, size)
        self._next_key += 1
        self.total_bytes += size
        while self.total_bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.total_bytes -= self.entries.pop(key)[2]

    def clear(self) -> None:
        self.entries.clear()
        self.total_bytes = 0
