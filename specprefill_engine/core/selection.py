"""Pick which prompt tokens the target prefills: chunks by mean importance.

Always kept: the tokens of `must_keep` (system prompt, tool schemas, template control
tokens: the caller marks them), the sequence's first `sink_tokens` absolute positions
(attention sinks, the chat template's start; 8 by default) and its last `tail_tokens` tokens (the
question and the template's end, so the first generated token comes from the real last
prompt token). `backbone_pct` adds evenly spaced chunks. What the budget has left goes
to the chunks with the highest mean importance.

What answers a lookup follows the place the question's words point at (a function's
body after its name, a value after its key), so before chunks are ranked each token's
importance is raised to the highest of the `spread` tokens before it. A point may
claim at most a `min_free_chunks`-th of the free budget that way (the width shrinks
with the budget: a short prompt's few kept chunks are not all one point's
neighbourhood), and the always-kept tokens (must_keep, the sinks) pass nothing on.

With `starts` (where a blank line begins a block: a paragraph, a function; the engine
reads them from the tokens' text) the units are those blocks, each kept whole or not at
all: a chunk cut from a function's middle shows the target one function's body after
another's name. A block longer than `longest_block` chunks is cut on the grid. The
always-kept tail then begins where the first block that starts inside it begins, so the
tail does not keep the end of the block before the question alone (a bare `return`
read as the asked function's).

Chunks lie on a grid anchored at absolute positions (boundaries at multiples of the
chunk size counted from position 0 of the whole sequence, `start` being the absolute
position of importance[0]), so a prefix-cache hit never shifts the grid. The chunk
size adapts to the budget: halved (down to `min_chunk_size`) until the free budget
holds at least `min_free_chunks` chunks, so a small keep picks several short spans
instead of one or two long ones. Selection depends only on the importance values and
the arguments (ties go to the earlier chunk).
"""

import math
from typing import Optional, Union

import mlx.core as mx
import numpy as np

ArrayLike = Union[mx.array, np.ndarray]


# the selection's defaults, here once (the engine's `EngineConfig` takes them too)
KEEP = 0.3  # share of the prompt's tokens kept
CHUNK_SIZE = 32  # tokens per chunk, halved down to 8 when the budget holds few chunks
TAIL_TOKENS = 32  # the prompt's last tokens, always kept
BACKBONE = 0.0  # share of chunks kept evenly spread, whatever their importance
SINK_TOKENS = 8  # the sequence's first positions, always kept (attention sinks)
SPREAD = 48  # tokens after an important one that inherit its importance, at most
LONGEST_BLOCK = 4  # chunks a block may span and stay one unit; a longer one is cut on the grid


def _host(values: Optional[ArrayLike], dtype) -> Optional[np.ndarray]:
    if values is None:
        return None
    if isinstance(values, mx.array):
        values = np.array(values)
    return np.asarray(values).astype(dtype).reshape(-1)


def effective_chunk_size(free_budget: int, chunk_size: int, min_chunk_size: int = 8,
                         min_free_chunks: int = 8) -> int:
    """`chunk_size` halved (not below `min_chunk_size`) until `free_budget` tokens hold
    at least `min_free_chunks` chunks."""
    size = chunk_size
    while size > min_chunk_size and free_budget < min_free_chunks * size:
        size = max(size // 2, min_chunk_size)
    return size


def spread_forward(values: np.ndarray, width: int, quiet: np.ndarray) -> np.ndarray:
    """Each entry raised to the highest of the `width` entries before it; entries where
    `quiet` is set pass nothing on."""
    source = np.where(quiet, 0.0, values).astype(values.dtype)
    covered = 1  # offsets 0 .. covered-1 are in source's running max
    while covered <= width:
        shift = min(covered, width + 1 - covered)
        source[shift:] = np.maximum(source[shift:], source[:-shift])
        covered += shift
    return np.maximum(values, source)


def forced_tokens(length: int, chunk_size: int = CHUNK_SIZE, backbone_pct: float = BACKBONE,
                  tail_tokens: int = TAIL_TOKENS, start: int = 0, sink_tokens: int = SINK_TOKENS,
                  must_keep: Optional[ArrayLike] = None) -> tuple[np.ndarray, np.ndarray]:
    """(must_keep mask, mask of the other always-kept tokens: sink, tail, backbone)."""
    positions = start + np.arange(length)
    sink = sink_tokens
    must = np.zeros(length, dtype=bool) if must_keep is None else _host(must_keep, bool)
    if must.size != length:
        raise ValueError(f"must_keep has {must.size} entries, importance has {length}")
    forced = (positions < sink) | (np.arange(length) >= length - max(tail_tokens, 1))
    first_chunk, last_chunk = start // chunk_size, (start + length - 1) // chunk_size
    n_chunks = last_chunk - first_chunk + 1
    n_backbone = round(backbone_pct * n_chunks)
    if n_backbone > 0:
        picked = first_chunk + np.linspace(0, n_chunks - 1, n_backbone).round().astype(np.int64)
        forced |= np.isin(positions // chunk_size, picked)
    return must, forced & ~must


def select_chunks(
    importance: ArrayLike,
    keep_pct: float = KEEP,
    chunk_size: int = CHUNK_SIZE,
    backbone_pct: float = BACKBONE,
    tail_tokens: int = TAIL_TOKENS,
    *,
    start: int = 0,
    must_keep: Optional[ArrayLike] = None,
    sink_tokens: int = SINK_TOKENS,
    min_chunk_size: int = 8,
    min_free_chunks: int = 8,
    spread: int = SPREAD,
    starts: Optional[ArrayLike] = None,
    longest_block: int = LONGEST_BLOCK,
) -> mx.array:
    """Sorted int32 indices (into `importance`) of the kept tokens.

    Budget rule: with K = must_keep's count and M = len(importance), the tokens kept
    besides must_keep number B = ceil(keep_pct * (M - K)): the sink, tail and backbone
    (always kept, even beyond B), then chunks by mean importance (spread forward by
    min(spread, free budget // min_free_chunks) tokens), best first (ties: the earlier
    chunk), each adding the tokens of it not kept yet, until B is reached; the
    last chunk may overshoot B by less than one chunk. With `starts`, a block of up to
    `longest_block` chunks is one unit in place of its chunks (and may overshoot by
    its length). must_keep's tokens come on top.
    keep_pct 1.0 keeps all. Defaults (sink 8, chunks of 32 down to 8) from the GPU quality
    grid in docs/benchmarks.md.
    """
    if not 0.0 < keep_pct <= 1.0:
        raise ValueError(f"keep_pct must be in (0, 1], got {keep_pct}")
    if not 0.0 <= backbone_pct <= 1.0:
        raise ValueError(f"backbone_pct must be in [0, 1], got {backbone_pct}")
    if chunk_size < 1 or min_chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if spread < 0:
        raise ValueError(f"spread must be >= 0, got {spread}")
    values = _host(importance, np.float32)
    length = values.size
    if length == 0:
        raise ValueError("importance is empty")
    if keep_pct == 1.0:
        return mx.arange(length, dtype=mx.int32)
    blocks = None if starts is None else _host(starts, bool)
    if blocks is not None:
        if blocks.size != length:
            raise ValueError(f"starts has {blocks.size} entries, importance has {length}")
        tail_from = max(length - max(tail_tokens, 1), 0)
        inside = np.flatnonzero(blocks[tail_from:])
        if inside.size:  # the tail from the first block that starts inside it
            tail_tokens = length - tail_from - int(inside[0])
    must, forced = forced_tokens(length, chunk_size, backbone_pct, tail_tokens, start,
                                 sink_tokens, must_keep)
    budget = math.ceil(keep_pct * (length - int(must.sum())))
    free_budget = budget - int(forced.sum())
    size = effective_chunk_size(max(free_budget, 0), chunk_size, min_chunk_size, min_free_chunks)
    positions = start + np.arange(length)
    width = min(spread, max(free_budget, 0) // min_free_chunks)
    if width > 0:
        values = spread_forward(values, width, must | (positions < sink_tokens))

    # chunks on the absolute grid (the first and last may be partial), or blocks
    chunk_of = positions // size - start // size
    if blocks is not None:
        block = np.cumsum(blocks)
        whole = np.bincount(block)[block] <= longest_block * size
        key = block * (int(chunk_of[-1]) + 2) + np.where(whole, 0, chunk_of + 1)
        chunk_of = np.unique(key, return_inverse=True)[1].reshape(-1)
    n_chunks = int(chunk_of.max()) + 1
    counts = np.bincount(chunk_of, minlength=n_chunks)
    means = np.bincount(chunk_of, weights=values, minlength=n_chunks) / counts
    already = np.bincount(chunk_of, weights=(must | forced), minlength=n_chunks)
    new_tokens = (counts - already).astype(np.int64)
    candidates = np.flatnonzero(new_tokens > 0)
    order = candidates[np.lexsort((candidates, -means[candidates]))]  # best first, stable
    # the best chunks until their new tokens reach the free budget (at most one chunk over)
    n_free = int(np.searchsorted(np.cumsum(new_tokens[order]), free_budget)) + 1 \
        if free_budget > 0 else 0
    chosen = np.zeros(n_chunks, dtype=bool)
    chosen[order[:n_free]] = True
    mask = must | forced | chosen[chunk_of]
    return mx.array(np.flatnonzero(mask).astype(np.int32))
