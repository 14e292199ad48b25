"""Attention by true position: sliding-window layers, and tokens fed out of order.

A sparse prefill feeds the kept tokens in order, so a `RotatingKVCache`'s own mask
(each query sees the last `window` entries) would let a kept token attend to kept
tokens far more than `window` positions back: distances such a layer never saw in
training. Dense attention with the dropped tokens masked out sees exactly the kept
keys k with q - window < k <= q. mlx-lm's models build their sliding mask by asking
the cache (`create_attention_mask(h, cache, window_size=...)` calls
`cache.make_mask`), so for one forward each rotating cache gets a `make_mask` that
answers with that mask by position; it is removed right after the call.

Which entries a rotating cache hands back after an update (concatenated, trimmed,
rotated) is mlx-lm's business: a shadow `RotatingKVCache` of the same size is fed the
positions in place of keys, so mlx-lm's own update logic says which position each
returned key has.

A plain `KVCache` (or `QuantizedKVCache`) appends in feed order, and its causal mask is
by that order: right as long as tokens come in position order. A repair
(`engine/planner.py`) feeds tokens of a dropped passage after entries of later
positions; for such a forward the plain layers get the mask by position too, each query
seeing the entries at or before its position.
"""

from contextlib import contextmanager
from functools import partial
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from .quantized_kv import PLAIN_KV

_EMPTY = -(2**30)  # the position of a slot that holds no entry: outside every window


def _entries(positions) -> mx.array:
    """Positions shaped as one cache update (batch 1, one head, n entries, width 1)."""
    return mx.array(np.asarray(positions, dtype=np.int32)).reshape(1, 1, -1, 1)


def _shadow(layer: RotatingKVCache, positions: np.ndarray) -> RotatingKVCache:
    """A rotating cache whose slots hold the positions of `layer`'s entries, given the
    positions of every entry fed to `layer` so far, in order."""
    shadow = RotatingKVCache(layer.max_size, layer.keep)
    if layer.keys is None:
        return shadow
    slots = layer.keys.shape[2]
    # the slot of each entry still held, oldest first (the first `keep` are never dropped)
    order = np.array(layer._temporal_order(_entries(np.arange(slots)))).reshape(-1)
    held = positions
    if order.size < positions.size:
        held = np.concatenate([positions[: layer.keep],
                               positions[positions.size - (order.size - layer.keep):]])
    values = np.full(slots, _EMPTY, dtype=np.int32)
    values[order] = held
    shadow.state = (_entries(values), _entries(values), layer.offset, layer.keep,
                    layer.max_size, layer._idx)
    return shadow


def _visible(queries: mx.array, keys: mx.array, N: int, window: Optional[int]) -> mx.array:
    """The mask by position, (N, keys): each query sees the keys at or before it (and,
    with `window`, within it)."""
    if N != queries.size:
        raise ValueError(f"a mask for {N} queries was asked, the forward has {queries.size}")
    mask = keys[None] <= queries[:, None]
    return mask & (keys[None] > queries[:, None] - window) if window else mask


def _window_mask(queries: mx.array, keys: mx.array, max_size: int, N: int,
                 window_size: Optional[int] = None, return_array: bool = False) -> mx.array:
    """`RotatingKVCache.make_mask`'s signature."""
    return _visible(queries, keys, N, window_size or max_size)  # as mlx-lm's make_mask reads it


class _CausalByPosition:
    """`KVCache.make_mask` for one forward of tokens fed out of order: each query sees
    the keys at or before its position. Every plain layer of the forward asks for the
    same mask, so it is built once (on the device) and shared."""

    def __init__(self, queries: np.ndarray, keys: np.ndarray):
        self.queries = mx.array(queries.astype(np.int32))
        self.keys = mx.array(keys.astype(np.int32))
        self.masks: dict = {}  # (N, window_size) -> mask

    def __call__(self, N: int, window_size: Optional[int] = None,
                 return_array: bool = False) -> mx.array:
        if (N, window_size) not in self.masks:
            self.masks[N, window_size] = _visible(self.queries, self.keys, N, window_size)
        return self.masks[N, window_size]


class SlidingWindows:
    """The true position of every entry of a prompt cache's rotating layers, and of its
    plain layers' entries (for a forward of tokens that precede some of them)."""

    def __init__(self, cache: list, positions: Optional[np.ndarray] = None):
        """`positions`: those of the entries already in `cache`, in order (None: 0..n-1)."""
        self.cache = cache  # its plain layers are looked up per forward: quantizing
        # the KV (`quantized_kv.py`) replaces them between chunks
        plain = self.plain
        self.fed = None  # the plain layers' entries' positions, in cache order
        if plain:
            self.fed = np.arange(plain[0].offset) if positions is None \
                else np.asarray(positions, dtype=np.int64).reshape(-1)
        self.groups = {}  # layers updated alike share one shadow: {state: (layers, shadow)}
        for layer in cache:
            if not isinstance(layer, RotatingKVCache):
                continue
            held = np.arange(layer.offset) if positions is None \
                else np.asarray(positions, dtype=np.int64).reshape(-1)
            if held.size != layer.offset:
                raise ValueError(f"cached_positions has {held.size} entries, the cache holds "
                                 f"{layer.offset}")
            key = (layer.max_size, layer.keep, layer.offset, layer._idx,
                   None if layer.keys is None else layer.keys.shape[2])
            if key not in self.groups:
                self.groups[key] = ([], _shadow(layer, held))
            self.groups[key][0].append(layer)

    @property
    def plain(self) -> list:
        """The cache's plain layers now (quantized or not)."""
        return [layer for layer in self.cache if type(layer) in PLAIN_KV]

    @contextmanager
    def by_position(self, positions: np.ndarray) -> Iterator[None]:
        """For one forward of tokens at `positions`: the rotating caches mask by position."""
        queries = mx.array(np.asarray(positions, dtype=np.int32))
        layers = []
        if self.fed is not None:
            positions = np.asarray(positions, dtype=np.int64).reshape(-1)
            keys = np.concatenate([self.fed, positions])
            if self.fed.size and positions.min() < self.fed.max():  # out of order
                mask = _CausalByPosition(positions, keys)
                for layer in self.plain:
                    layer.make_mask = mask
                    layers.append(layer)
            self.fed = keys
        for group, shadow in self.groups.values():
            keys, _ = shadow.update_and_fetch(_entries(positions), _entries(positions))
            keys = keys.reshape(-1)
            mx.eval(keys, shadow.keys)  # tiny; keeps each chunk's shadow off the next one's graph
            for layer in group:
                layer.make_mask = partial(_window_mask, queries, keys, layer.max_size)
                layers.append(layer)
        try:
            yield
        finally:
            for layer in layers:
                layer.__dict__.pop("make_mask", None)
