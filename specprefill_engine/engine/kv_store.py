"""The prefix cache's tensors: each entry's KV and checkpoints, by key (the executor's).

The planner's index (`prefix_cache.py`) decides every entry's key, what a store
absorbs and what is dropped; this store holds what those decisions name and does only
what a plan tells it, the same on every rank of a sharded target. An entry holds, per
layer, the (keys, values) of every entry it was fed (a plain `KVCache`, cut to any
prefix at restore), or nothing: layers that cannot be cut (conv/SSM states, sliding
windows, `CacheList`, ...) are kept as checkpoints, their state at chosen prefix
lengths, where a checkpoint at L is the state after every entry at a position < L was
fed and nothing else.

A snapshot holds references to the state arrays, not copies: MLX arrays are values, a
cache's later writes make new arrays (copying a buffer only while a snapshot still
holds it). Snapshots are rebuilt through mlx-lm's own `state` / `from_state`, as its
`save_prompt_cache` / `load_prompt_cache` do, so every cache class is served alike.
Stored KV is held as given, views included: a caller storing part of a live buffer it
will go on writing (a batch's) hands in a copy.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache

from ..core.prefill import cache_length
from ..core.quantized_kv import PLAIN_KV, restored_layer, stored_entries

MAX_CHECKPOINTS = 16  # per entry; the longest are kept, the ones a next turn can use


def cuttable(layer) -> bool:
    """A plain KV cache (quantized or not) can be cut to any prefix; other layers need
    checkpoints."""
    return type(layer) in PLAIN_KV


def reusable(cache: list) -> bool:
    """Every layer can be cut at any length: a prefix of any length is reusable."""
    return all(cuttable(c) for c in cache)


def supported(cache: list) -> bool:
    """Every layer can be cut or rebuilt from its `state`, so a prefix cache serves it."""
    return all(cuttable(c) or hasattr(c, "from_state") for c in cache)


def serves(model, max_bytes: int) -> bool:
    """Whether a prefix cache of `max_bytes` serves `model`: it has a budget and every
    cache layer can be cut or rebuilt."""
    return bool(max_bytes) and supported(make_prompt_cache(model))


def checkpointed(model) -> bool:
    """Whether the model's cache has layers that cannot be cut, so that a prefix is
    reusable only where a snapshot was taken."""
    return not reusable(make_prompt_cache(model))


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


def snapshot(cache: list) -> Snapshot:
    """The cache's uncuttable layers now, by reference: cheap enough to take at every
    point a later prompt may share (each chat message's end, the prompt's end)."""
    layers = {i: (type(c), _hold(c.state)) for i, c in enumerate(cache) if not cuttable(c)}
    return Snapshot(layers, cache_length(cache, None), tree_nbytes(list(layers.values())))


def _states(checkpoints: dict) -> list:
    return [state for s in checkpoints.values() for _, state in s.layers.values()]


@dataclass
class Held:
    """One entry's tensors."""

    # per layer: (keys, values) of every stored entry (quantized: `stored_entries`), or
    # None (checkpointed)
    kv: list
    checkpoints: dict  # prefix length -> Snapshot, ascending

    @property
    def nbytes(self) -> int:
        return tree_nbytes(self.kv) + sum(s.nbytes for s in self.checkpoints.values())


def count_before(positions: Optional[np.ndarray], size: int, position: int) -> int:
    """How many leading entries (in the order they were fed) are at positions before
    `position`, of an entry of `size` tokens whose entries sit at `positions` (None:
    0..size-1): the entries a restore there keeps. A repaired view holds a passage fed
    after later positions; a cut before it stops at its first entry past the cut."""
    if positions is None:
        return min(position, size)
    past = np.flatnonzero(positions >= position)
    return int(past[0]) if past.size else int(positions.size)


def validated(tokens: np.ndarray, positions: Optional[np.ndarray], checkpoints: dict,
              cache: list) -> None:
    """A store's arguments, each fault named."""
    if positions is not None:
        if positions.ndim != 1 or positions.size > tokens.size or (positions.size and (
                positions.min() < 0 or positions.max() >= tokens.size
                or np.unique(positions).size != positions.size)):
            raise ValueError("positions must be distinct positions within tokens")
    layers = {i for i, c in enumerate(cache) if not cuttable(c)}
    for length, snap in checkpoints.items():
        if not 0 < length <= tokens.size:
            raise ValueError(f"checkpoints: length {length} is outside 1..{tokens.size}")
        if set(snap.layers) != layers:
            raise ValueError(f"checkpoints: the snapshot at {length} is of another model's cache")
        want = count_before(positions, tokens.size, length)
        if snap.fed is not None and snap.fed != want:
            raise ValueError(f"checkpoints: the snapshot at {length} was taken after "
                             f"{snap.fed} entries, not {want}")


class KVStore:
    """`max_bytes`: the most one entry may hold (the index keeps the total within the
    budget by its drops); `max_checkpoints`: per entry, the longest kept; `disk`: the
    `disk_cache.DiskTier` its entries are written to and read from (None: none)."""

    def __init__(self, max_bytes: int, max_checkpoints: int = MAX_CHECKPOINTS, disk=None):
        self.max_bytes = max_bytes
        self.max_checkpoints = max_checkpoints
        self.disk = disk
        self.held: dict[int, Held] = {}

    def put(self, store, cache: list, checkpoints: dict) -> Optional[Held]:
        """Keep `cache`, which was fed all of `store.tokens` (or, with `store.positions`,
        one entry per listed position), with `checkpoints` taken on the way, as
        `store.key`: a new entry taking the checkpoints of those it absorbs
        (`store.absorbs`, dropped by the caller), or (`store.into`) an entry already
        held that only gains checkpoints. The cache's own state is the checkpoint at
        len(tokens). The size is known before anything is copied: None when the entry
        would exceed `max_bytes`, or the cache lacks entries it should hold."""
        tokens, positions = store.tokens, store.positions
        checkpoints = dict(checkpoints)
        validated(tokens, positions, checkpoints, cache)
        count = tokens.size if positions is None else positions.size
        fed = cache_length(cache, None)
        if count == 0 or any(c.offset < count for c in cache if cuttable(c)):
            return None
        if reusable(cache):
            checkpoints = {}  # any length can be cut
        elif fed is None or fed == count:
            checkpoints[tokens.size] = snapshot(cache)
        elif not checkpoints:
            return None  # fed past the tokens and nothing to restore from
        if store.into:
            return self._add_checkpoints(store.key, checkpoints)
        for key in store.absorbs:
            if key in self.held:
                checkpoints = {**self.held[key].checkpoints, **checkpoints}
        kv = [stored_entries(c, count) if cuttable(c) else None for c in cache]
        held = Held(kv, self._bounded(checkpoints))
        if held.nbytes > self.max_bytes:
            return None
        mx.eval(held.kv, _states(held.checkpoints))  # a failed copy fails here, changing nothing
        self.held[store.key] = held
        return held

    def _bounded(self, checkpoints: dict) -> dict:
        lengths = sorted(checkpoints)[-self.max_checkpoints:]
        return {length: checkpoints[length] for length in lengths}

    def _add_checkpoints(self, key: int, checkpoints: dict) -> Optional[Held]:
        held = self.held.get(key)
        if held is None:
            return None
        merged = Held(held.kv, self._bounded({**checkpoints, **held.checkpoints}))
        if merged.nbytes > self.max_bytes:
            return None
        mx.eval(_states(merged.checkpoints))
        held.checkpoints = merged.checkpoints
        return held

    def add(self, key: int, held: Held) -> None:
        """An entry read back from the disk tier."""
        self.held[key] = held

    def restore(self, model, key: int, cut: int, count: int) -> list:
        """A fresh cache holding entry `key`'s first `count` entries (those at positions
        before `cut`). For a layer that cannot be cut `cut` must be one of the entry's
        checkpoints."""
        cache = make_prompt_cache(model)
        if cut <= 0:
            return cache
        held = self.held[key]
        for i, layer in enumerate(held.kv):
            if layer is None:
                if cut not in held.checkpoints:
                    raise ValueError(f"cut {cut} is not restorable from this entry (its "
                                     f"checkpoints: {sorted(held.checkpoints)})")
                kind, state = held.checkpoints[cut].layers[i]
                cache[i] = kind.from_state(_hold(state))
            elif count:
                cache[i] = restored_layer(layer, count)
        return cache

    def drop(self, key: int) -> None:
        self.held.pop(key, None)

    def clear(self) -> None:
        self.held.clear()
