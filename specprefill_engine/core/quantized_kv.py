"""Quantized KV, mlx-lm's way: `kv_bits`, `kv_group_size`, `quantized_kv_start`.

As in mlx-lm's `generate_step`, a cache starts at the model's dtype and each plain KV
layer becomes a `QuantizedKVCache` after the first forward (a prefill chunk, a decode
step) that leaves it holding `start` entries or more; from then on every entry is
stored quantized (mx.quantize, groups of `group_size` along the head dimension) and the
model's attention reads it through mlx-lm's quantized attention. A sparse view counts
its own entries, not positions: it is quantized when it holds `start` entries.

A plain layer, quantized or not, appends entries in feed order and can be cut at any
length, so prefix caches, repairs and densify treat both alike (`PLAIN_KV`,
`cut_layer`). Stored entries are (keys, values) or, quantized, (keys, values,
group_size, bits) with keys and values as mx.quantize's (weights, scales, biases).
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

KV_GROUP_SIZE = 64  # mlx-lm's default
QUANTIZED_KV_START = DEFAULT_QUANTIZED_KV_START
PLAIN_KV = (KVCache, QuantizedKVCache)  # layers that append entries and cut anywhere


@dataclass(frozen=True)
class QuantizedKV:
    """How a running request's target KV is quantized (mlx-lm's three settings)."""

    bits: int
    group_size: int = KV_GROUP_SIZE
    start: int = QUANTIZED_KV_START

    def apply(self, cache: list) -> None:
        """mlx-lm's `maybe_quantize_kv_cache`: the plain layers holding `start` entries
        or more become quantized (in place, in the list)."""
        maybe_quantize_kv_cache(cache, self.start, self.group_size, self.bits)

    def ratio(self, itemsize: int) -> float:
        """Quantized bytes per element of a KV entry, over the dtype's: the packed bits
        plus a scale and a bias per group, both in the dtype."""
        return (self.bits / 8 + 2 * itemsize / self.group_size) / itemsize


def check_kv_bits(bits, group_size, start) -> None:
    """mlx-lm's settings, each fault named."""
    if bits is not None and (isinstance(bits, bool) or bits not in (4, 8)):
        raise ValueError(f"kv_bits must be None (off), 4 or 8, got {bits!r}")
    if isinstance(group_size, bool) or group_size not in (32, 64, 128):
        raise ValueError(f"kv_group_size must be 32, 64 or 128, got {group_size!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"quantized_kv_start must be an integer >= 0, got {start!r}")


def quantized_kv_support(model: nn.Module, kv: QuantizedKV) -> str:
    """Why this model's KV cannot be quantized so; "" when it can. Decided by trying:
    two tokens, the cache quantized, one more token through quantized attention."""
    try:
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2]]), cache=cache)
        QuantizedKV(kv.bits, kv.group_size, 0).apply(cache)
        if not any(isinstance(c, QuantizedKVCache) for c in cache):
            return "the model's cache has no plain KV layer to quantize"
        mx.eval(model(mx.array([[3]]), cache=cache))
    except Exception as error:  # e.g. a sliding-window layer: mlx-lm has no quantized one
        return f"{type(error).__name__}: {error}"
    return ""


def cut_layer(layer, count: int):
    """A plain layer's first `count` entries as a layer of its class, views (no copy)."""
    part = QuantizedKVCache(layer.group_size, layer.bits) if isinstance(
        layer, QuantizedKVCache) else KVCache()
    part.keys, part.values = tree_map(lambda x: x[..., :count, :], (layer.keys, layer.values))
    part.offset = count
    return part


def stored_entries(layer, count: int) -> tuple:
    """A plain layer's first `count` entries as a prefix cache holds them."""
    part = cut_layer(layer, count)
    if isinstance(part, QuantizedKVCache):
        return part.keys, part.values, part.group_size, part.bits
    return part.keys, part.values


def restored_layer(stored: tuple, count: int):
    """A layer holding the first `count` of `stored`'s entries (`stored_entries`)."""
    if len(stored) == 4:
        layer = QuantizedKVCache(stored[2], stored[3])
    else:
        layer = KVCache()
    layer.keys, layer.values = tree_map(lambda x: x[..., :count, :], tuple(stored[:2]))
    layer.offset = count
    return layer


def is_quantized(stored: tuple) -> bool:
    return len(stored) == 4


def kv_bytes(rate: int, entries: int, kv: Optional[QuantizedKV], itemsize: int) -> int:
    """Bytes of `entries` KV entries at `rate` bytes per entry in the model's dtype,
    quantized by `kv` (None: not) once they reach its start."""
    if kv is None or entries < kv.start:
        return rate * entries
    return int(rate * entries * kv.ratio(itemsize))


def cut_cache(cache: list, count: int) -> list:
    """The first `count` entries of a row's plain KV caches (quantized or not), as views
    (no copy: a later write into the live cache copies its buffer first, MLX arrays being
    values); the layers that cannot be cut as they are (they hold what the row was fed)."""
    return [cut_layer(layer, count) if type(layer) in PLAIN_KV else layer for layer in cache]
