"""Find where a model applies RoPE and which cache each attention layer writes.

Everything here reads the model's structure (its modules and cache types), never
its config name: a module that owns a `rope` child is an attention layer, and the
cache list from `make_prompt_cache` tells which cache entry belongs to it.
"""

from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


class UnsupportedModelError(ValueError):
    """The core cannot run SpecPrefill on this model; the reason says why."""


@dataclass(frozen=True)
class AttentionSite:
    layer_index: int
    cache_index: int
    attention: nn.Module


def decoder_layers(model: nn.Module) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise UnsupportedModelError(
            f"{type(model).__module__}: no `layers` list to inspect"
        )
    return list(layers)


def _attention_module(layer: nn.Module):
    """The child of `layer` that owns a `rope`, or None."""
    for child in layer.children().values():
        if isinstance(child, nn.Module) and isinstance(child.get("rope"), nn.Module):
            return child
    return None


def rope_owners(model: nn.Module) -> list[nn.Module]:
    """The attention modules whose `rope` child SpecPrefill wraps."""
    owners = [_attention_module(layer) for layer in decoder_layers(model)]
    return [owner for owner in owners if owner is not None]


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """One site per attention layer that rotates with a `rope` module."""
    layers = decoder_layers(model)
    cache = make_prompt_cache(model)
    if len(cache) != len(layers):
        raise UnsupportedModelError(
            f"{type(model).__module__}: {len(cache)} caches for {len(layers)} layers"
        )
    sites = []
    for index, layer in enumerate(layers):
        attention = _attention_module(layer)
        if attention is not None:
            sites.append(AttentionSite(index, index, attention))
    if not sites:
        raise UnsupportedModelError(
            f"{type(model).__module__}: no attention layer with a `rope` module"
        )
    return sites


def sees_whole_prompt(layer_cache, prompt_length: int) -> bool:
    """Whether a cache keeps every prompt key (a sliding window may not)."""
    if isinstance(layer_cache, RotatingKVCache):
        return layer_cache.max_size >= prompt_length
    return isinstance(layer_cache, KVCache)
