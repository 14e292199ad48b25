"""The one chunked-prefill routine: dense or sparse, target or draft.

Tokens go through the model a chunk at a time, each chunk in its own forward call
so a caller can interleave other work between chunks (the engine: decode steps). A
chunk's cost grows with the entries already cached (attention), so on a CPU chunks are
cost-balanced: the first is `step_size` tokens and later ones shrink so that each costs
about as many FLOPs (`unit_tokens`). Chunk ends lie on the grid of a prefill from 0 and
never depend on load, so a prompt's KV is the same whatever else runs, and a cached
prefix cut at a chunk end continues in the same chunks as from scratch. A small last
chunk runs right after the one before it, so it costs no turn of its own.
With `positions` (sparse prefill: the kept tokens' original positions) every call
gets its own position handling, removed right after it: RoPE at those positions
(`positions.py`) and sliding-window masks by them (`windows.py`);
without, the call still resets whatever state another request's call may have left
on a shared model (mlx-vlm's rope-delta carrier).
"""

from itertools import takewhile
from typing import Generator, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from .adapters import takes_position_ids
from .positions import position_runs, positioned_rope
from .windows import SlidingWindows

_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "vocab_size")


def unit_weight(model: nn.Module) -> float:
    """Attention FLOPs per cached entry, relative to the linear FLOPs, per token:
    a token attending to s entries costs (1 + weight * s) times a token at s = 0.
    From the model's config (the same on every rank of a sharded model); 0 (chunks
    of fixed size) when the config lacks a field."""
    args = getattr(model, "args", None)
    values = [getattr(args, name, None) for name in _CONFIG_FIELDS]
    if not all(isinstance(v, int) and v > 0 for v in values):
        return 0.0
    hidden, layers, heads, intermediate, vocab = values
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or hidden // heads
    linear = layers * (hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * intermediate)
    linear += hidden * vocab
    return 2 * layers * heads * head_dim / linear  # QK^T and AV: 4*H*D per layer; linear: 2*params


def prefill_weight(model: nn.Module, balanced: Optional[bool] = None) -> float:
    """The weight chunks are balanced by: `unit_weight` where balanced, else 0. By
    default balanced on a CPU only: there attention dominates a chunk at long context,
    while a GPU's attention is cheap next to the cost of small chunks (both measured:
    docs/how-it-works.md, "Batching")."""
    if balanced is None:
        balanced = mx.default_device() == mx.cpu
    return unit_weight(model) if balanced else 0.0


STEP_SIZE = 2048  # tokens per prefill chunk by default (the engine's on a GPU)

# a last chunk costing at most this share of a unit runs right after the chunk before
# it, without yielding in between: a short tail would otherwise take a turn of its own
# (in the engine, a decode step by which the request starts later)
TAIL_SHARE = 0.25


def chunk_cost(tokens: int, cached: int, weight: float) -> float:
    """A chunk's cost in token-equivalents at cache length 0."""
    return tokens * (1 + weight * (cached + tokens / 2))


def unit_tokens(step_size: int, cached: int, weight: float) -> int:
    """Tokens in the chunk that starts after `cached` entries: n with
    chunk_cost(n, cached) = chunk_cost(step_size, 0)."""
    if weight <= 0:
        return step_size
    budget = chunk_cost(step_size, 0, weight)
    linear = 1 + weight * cached
    n = 2 * budget / (linear + (linear * linear + 2 * weight * budget) ** 0.5)  # no cancellation
    return max(1, min(step_size, int(n + 1e-9)))


def _unit_ends(cached: int, step_size: int, weight: float) -> Iterator[int]:
    """Where successive full units end, counted from `cached` entries on (endless)."""
    end = 0
    while True:
        end += unit_tokens(step_size, cached + end, weight)
        yield end


def chunk_plan(total: int, cached: int, step_size: int, weight: float) -> list:
    """(end, pause) for each chunk of `total` tokens fed after `cached` entries: where
    it ends, and whether a turn may follow it (not before a last chunk that costs at
    most `TAIL_SHARE` of a unit). The ends lie on the grid of a prefill from 0,
    so after a cached prefix every chunk but the first and the last has the shape it
    has from scratch (a GPU's attention is planned per shape, see `fit_buffers`); a
    first piece up to the grid that costs at most `TAIL_SHARE` of a unit joins the
    chunk after it."""
    if total < 1:
        return []
    grid = (end - cached for end in _unit_ends(0, step_size, weight) if end > cached)
    ends = [*takewhile(lambda end: end < total, grid), total]
    small = TAIL_SHARE * chunk_cost(step_size, 0, weight)
    if len(ends) > 1 and chunk_cost(ends[0], cached, weight) <= small:
        ends = ends[1:]
    pauses = [True] * len(ends)
    if len(ends) > 1 and chunk_cost(total - ends[-2], cached + ends[-2], weight) <= small:
        pauses[-2] = False
    return list(zip(ends, pauses))


def fit_buffers(cache: list, tokens: int) -> None:
    """Size each plain KV layer's buffer to exactly its entries after a chunk of
    `tokens`, so the chunk's attention reads contiguous keys of its end length. MLX's
    CUDA attention (cuDNN) builds a plan per shape and stride of the keys: a prefill
    continued from a restored prefix then reuses the plans of a prefill from 0 on the
    same grid instead of building one per chunk. Only for chunks of
    at least mlx-lm's growth step, for which its own growth copies the cache anyway;
    smaller ones (a CPU's cost-balanced chunks at long context) keep its growth, which
    reuses the room it leaves."""
    if tokens < KVCache.step:
        return
    for layer in cache:
        if type(layer) is not KVCache or layer.keys is None:
            continue
        if layer.keys.shape[2] != layer.offset + tokens:
            _resize(layer, layer.offset, layer.offset + tokens)


def _resize(layer, count: int, size: int) -> None:
    """A KV layer's buffers, new, of `size` entries: its first `count`, then zeros."""
    grown = []
    for array in (layer.keys, layer.values):
        shape = (*array.shape[:2], size - count, array.shape[3])
        grown.append(mx.concatenate([array[..., :count, :], mx.zeros(shape, array.dtype)],
                                    axis=2))
    layer.keys, layer.values = grown


def align_buffers(cache: list) -> None:
    """Size each plain or batched KV layer's buffer to a multiple of mlx-lm's growth step,
    with room for the next token, before decoding: a decode step's attention reads the
    keys through the buffer's strides, and MLX's CUDA attention reads them fastest from
    buffers of such lengths; the cache's own growth keeps them so after. A prefill leaves
    buffers of exact sizes (`fit_buffers`), as mlx-lm's batch caches do when they merge."""
    for layer in cache:
        if type(layer) not in (KVCache, BatchKVCache) or layer.keys is None:
            continue
        count, length = layer.size(), layer.keys.shape[2]
        if length % KVCache.step or length == count:
            _resize(layer, count, (count // KVCache.step + 1) * KVCache.step)


def logits_of(output) -> mx.array:
    """mlx-lm models return logits; mlx-vlm language models an object holding them."""
    return output if isinstance(output, mx.array) else output.logits


def _forward(model: nn.Module, inputs: mx.array, cache, positions: Optional[np.ndarray],
             windows: Optional[SlidingWindows]):
    if positions is None:
        with positioned_rope(model):
            return model(inputs, cache=cache)
    with windows.by_position(positions):
        if takes_position_ids(model):  # text tokens: one position row, as the model lays out its own
            with positioned_rope(model):
                return model(inputs, cache=cache, position_ids=mx.array(positions, mx.int32)[None])
        with positioned_rope(model, runs=position_runs(positions)):
            return model(inputs, cache=cache)


def prefill_chunk(model: nn.Module, tokens: mx.array, cache: list,
                  positions: Optional[np.ndarray] = None, want_logits: bool = False,
                  windows: Optional[SlidingWindows] = None):
    """One forward of `tokens` (1-D) into `cache`, evaluated; the last token's logits,
    shape (1, 1, vocab), when `want_logits`, else None. `positions`: each token's
    absolute position (sparse prefill), else they follow the cache; `windows`, with
    them: the true position of every entry the cache's sliding-window layers hold, kept
    across a prompt's chunks (by default the cache holds positions 0..n-1)."""
    if positions is not None and windows is None:
        windows = SlidingWindows(cache)
    fit_buffers(cache, tokens.size)
    output = _forward(model, tokens[None], cache, positions, windows)
    if want_logits:
        logits = logits_of(output)[:, -1:, :]
        mx.eval(logits, [c.state for c in cache])
        return logits
    mx.eval([c.state for c in cache])
    return None


def cache_length(cache: list, default: Optional[int] = 0) -> Optional[int]:
    """Entries the cache holds (the first layer with an integer offset; `default` when no
    layer counts them)."""
    return next((c.offset for c in cache if isinstance(getattr(c, "offset", None), int)),
                default)


def chunked_prefill(
    model: nn.Module,
    tokens: mx.array,
    cache: list,
    step_size: int,
    positions: Optional[np.ndarray] = None,
    want_logits: bool = True,
    balanced: Optional[bool] = None,
    cached_positions: Optional[np.ndarray] = None,
) -> Generator[tuple, None, Optional[mx.array]]:
    """Feed `tokens` in the chunks of `chunk_plan`, yielding (tokens done, tokens)
    where the plan lets a turn in; the last yield is (total, total).

    Returns the last token's logits, shape (1, 1, vocab), or None when
    `want_logits` is False (only the cache is wanted, e.g. a draft before its
    lookahead). `positions`, when given, holds each token's absolute position, and
    `cached_positions` those of the entries already in `cache` (None: 0..n-1): a
    sliding-window layer then sees the keys inside its window by those positions.
    `balanced` (None: the device's default, `prefill_weight`) shrinks later chunks so
    each costs as much; False keeps every chunk at `step_size` tokens.
    """
    if step_size < 1:
        raise ValueError(f"step_size must be >= 1, got {step_size}")
    tokens = tokens.reshape(-1)
    total = tokens.size
    weight = prefill_weight(model, balanced)
    windows = None if positions is None else SlidingWindows(cache, cached_positions)
    logits, start = None, 0
    for end, pause in chunk_plan(total, cache_length(cache), step_size, weight):
        chunk_positions = None if positions is None else positions[start:end]
        logits = prefill_chunk(model, tokens[start:end], cache, chunk_positions,
                               want_logits and end == total, windows)
        start = end
        if pause:
            yield end, total
    return logits
