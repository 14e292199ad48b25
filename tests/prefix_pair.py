"""The prefix cache's index and its tensors driven together, as the worker drives them
across a turn (a store planned, run, then committed; a disk read planned, run, then
committed), for the tests that exercise the cache itself."""

from typing import Optional

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine.engine.kv_store import MAX_CHECKPOINTS, KVStore, reusable
from specprefill_engine.engine.plan import Store
from specprefill_engine.engine.prefix_cache import Hit, PrefixIndex


class PrefixPair:
    def __init__(self, max_bytes: int = 2 << 30, max_checkpoints: int = MAX_CHECKPOINTS,
                 disk=None):
        self.index = PrefixIndex(max_bytes, disk=disk)
        self.kv = KVStore(max_bytes, max_checkpoints, disk)

    @property
    def entries(self):
        return self.index.entries

    @property
    def max_bytes(self) -> int:
        return self.index.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self.index.max_bytes = self.kv.max_bytes = value

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    @property
    def disk(self):
        return self.index.disk

    def find(self, tokens, dense_only: bool = False) -> Optional[Hit]:
        return self.index.find(np.asarray(tokens), dense_only)

    def store(self, tokens, cache, positions=None, checkpoints=None, keep: float = 1.0
              ) -> Optional[int]:
        self.index.cuts_anywhere = reusable(cache)
        op = Store(-1, np.asarray(tokens), None if positions is None else np.asarray(positions),
                   keep)
        self.index.plan_store(op)
        try:
            held = self.kv.put(op, cache, checkpoints or {})
        except Exception:
            self.index.commit(op, None)
            raise
        if held is None:
            self.index.commit(op, None)
            return None
        if not op.into:
            for key in op.absorbs:
                self.kv.drop(key)
        self.index.commit(op, tuple(held.checkpoints), held.nbytes)
        return op.key

    def held(self, key: int):
        return self.kv.held[key]

    def touch(self, key: int) -> None:
        self.index.touch(key)

    def evictions(self, pinned=()) -> list:
        return self.index.evictions(pinned)

    def drop(self, key: int) -> None:
        self.index.drop(key)
        self.kv.drop(key)

    def persist(self, key: int) -> None:
        persist = self.index.persist(key)
        if persist is not None:
            name = self.kv.disk.write(persist.entry, self.kv.held[key])
            self.index.persisted(persist, name)

    def promote(self, tokens, dense_only: bool = False) -> Optional[Hit]:
        load = self.index.promote(np.asarray(tokens), dense_only)
        if load is None:
            return None
        held = self.kv.disk.read(load.stub)
        if held is not None:
            self.kv.add(load.key, held)
        self.index.loaded(load.key, None if held is None else held.nbytes)
        return self.find(tokens, dense_only) if held is not None else None

    def restore(self, model, hit: Optional[Hit], cut: int):
        """A fresh cache from `hit`'s entries before `cut`, and their positions."""
        if hit is None or cut <= 0:
            return make_prompt_cache(model), None
        entry = hit.entry
        cache = self.kv.restore(model, entry.key, cut, entry.count_before(cut))
        return cache, entry.held_before(cut)
