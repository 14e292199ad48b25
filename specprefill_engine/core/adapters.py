"""Find where a model applies RoPE and which cache each layer writes.

Everything here reads the model's structure (its modules and cache types), never
its config name:
- a layer's child that owns a `rope` module is an attention layer with RoPE;
- a layer that owns key projections is attention (with or without RoPE), one that
  owns a `conv1d` is a recurrent mixer (Mamba, GatedDeltaNet); both hold a cache,
  other layers (plain MLP blocks in Nemotron-H) do not. That gives the
  layer-to-cache mapping when the model makes fewer caches than it has layers.
"""

import functools
import inspect
from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

KEY_PROJECTIONS = ("k_proj", "kv_proj", "qkv_proj", "kv_a_proj_with_mqa", "query_key_value")


class UnsupportedModelError(ValueError):
    """The core cannot run SpecPrefill on this model; the reason says why."""


@dataclass(frozen=True)
class AttentionSite:
    """An attention layer, its cache, and the child whose output is its query:
    `rope` (post-RoPE queries) or, for attention without RoPE, `q_proj`."""

    layer_index: int
    cache_index: int
    attention: nn.Module
    query_source: str = "rope"


def decoder_layers(model: nn.Module) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__module__}: no `layers` list to inspect")
    return list(layers)


def _attention_module(layer: nn.Module):
    """The child of `layer` that owns a `rope`, or None."""
    for child in layer.children().values():
        if isinstance(child, nn.Module) and isinstance(child.get("rope"), nn.Module):
            return child
    return None


def _unrotated_attention(layer: nn.Module):
    """The child of `layer` with query and key projections but no `rope`, or None."""
    for child in layer.children().values():
        if isinstance(child, nn.Module) and isinstance(child.get("q_proj"), nn.Module) \
                and isinstance(child.get("k_proj"), nn.Module) \
                and "rope" not in child and "rotary_emb" not in child:
            return child
    return None


def position_carrier(model: nn.Module):
    """The module holding mlx-vlm's `_rope_deltas`: the model, or the language model
    it wraps (a text-only view of a VLM), or None."""
    for candidate in (model, model.get("language_model")):
        if candidate is not None and hasattr(candidate, "_rope_deltas"):
            return candidate
    return None


def takes_position_ids(model: nn.Module) -> bool:
    """mlx-vlm language models with multi-axis RoPE (Qwen-VL family, GLM-4V): their
    attention rotates with a `rotary_emb` driven by explicit `position_ids`, and decode
    positions come from cache offset + `_rope_deltas`, the carrier we set."""
    return position_carrier(model) is not None and any(
        isinstance(module.get("rotary_emb"), nn.Module)
        for layer in decoder_layers(model) for module in layer.children().values()
        if isinstance(module, nn.Module)
    )


def first_attention_cache(model: nn.Module, cache: list):
    """The cache of the first attention layer: its offset counts tokens fed so far."""
    indices = cache_indices(model, len(cache))
    for index, layer in enumerate(decoder_layers(model)):
        if has_attention(layer):
            return cache[indices[index]]
    raise UnsupportedModelError(f"{type(model).__module__}: no attention layers")


def _owns(layer: nn.Module, names) -> bool:
    return any(isinstance(module.get(name), nn.Module)
               for _, module in layer.named_modules() for name in names)


def has_attention(layer: nn.Module) -> bool:
    return _attention_module(layer) is not None or _owns(layer, KEY_PROJECTIONS)


def _holds_cache(layer: nn.Module) -> bool:
    return has_attention(layer) or _owns(layer, ("conv1d",))


@functools.lru_cache(maxsize=None)
def _takes_offset(rope_class: type) -> bool:
    """Whether a RoPE class's call takes an `offset` (checked once per class: this runs
    around every prefill chunk)."""
    return "offset" in inspect.signature(rope_class.__call__).parameters


def _checked_rope(owner: nn.Module, model: nn.Module) -> nn.Module:
    rope = owner["rope"]
    call = getattr(rope, "inner", rope)  # already wrapped by us: check the original
    if not _takes_offset(type(call)):
        raise UnsupportedModelError(
            f"{type(model).__module__}: unknown RoPE {type(call).__name__} (its call takes no "
            "`offset`), so kept tokens cannot be given their positions"
        )
    return rope


def rope_owners(model: nn.Module) -> list[nn.Module]:
    """The attention modules whose `rope` child SpecPrefill wraps (may be none)."""
    owners = [_attention_module(layer) for layer in decoder_layers(model)]
    owners = [owner for owner in owners if owner is not None]
    for owner in owners:
        _checked_rope(owner, model)
    return owners


def cache_indices(model: nn.Module, n_caches: int) -> list:
    """For each layer, the index of its cache in `make_prompt_cache`, or None."""
    layers = decoder_layers(model)
    if n_caches == len(layers):
        return list(range(len(layers)))
    holders = [_holds_cache(layer) for layer in layers]
    if sum(holders) != n_caches:
        raise UnsupportedModelError(
            f"{type(model).__module__}: {n_caches} caches for {len(layers)} layers, and the "
            "layers that hold a cache cannot be told from the structure"
        )
    indices, next_index = [], 0
    for holds in holders:
        indices.append(next_index if holds else None)
        next_index += holds
    return indices


def check_sparse_prefill_supported(model: nn.Module) -> None:
    """Sparse prefill needs attention somewhere (pure SSMs gain nothing) and known RoPE."""
    if not any(has_attention(layer) for layer in decoder_layers(model)):
        raise UnsupportedModelError(f"{type(model).__module__}: no attention layers")
    rope_owners(model)


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """One site per attention layer whose queries can be read (RoPE or plain q_proj)."""
    layers = decoder_layers(model)
    indices = cache_indices(model, len(make_prompt_cache(model)))
    sites = []
    for index, layer in enumerate(layers):
        attention = _attention_module(layer)
        if attention is not None:
            _checked_rope(attention, model)
            sites.append(AttentionSite(index, indices[index], attention, "rope"))
        elif (attention := _unrotated_attention(layer)) is not None:
            sites.append(AttentionSite(index, indices[index], attention, "q_proj"))
    if not sites:
        raise UnsupportedModelError(f"{type(model).__module__}: no attention layers to score with")
    return sites


def sees_whole_prompt(layer_cache, prompt_length: int) -> bool:
    """Whether a cache keeps every prompt key (a sliding window may not)."""
    if isinstance(layer_cache, RotatingKVCache):
        return layer_cache.max_size >= prompt_length
    return isinstance(layer_cache, KVCache)


def sliding_window(cache: list) -> int:
    """The largest sliding window among the caches, 0 if none."""
    return max((c.max_size for c in cache if isinstance(c, RotatingKVCache)), default=0)
