"""Give kept tokens their original RoPE positions by wrapping the model's RoPE.

During sparse prefill the cache offset counts kept tokens (N), not prompt
positions. `PositionedRoPE` replaces each attention layer's `rope` for one forward
and rotates every kept token at its true position in ONE call of the model's own
RoPE module: the (1, heads, N, dim) input is viewed as N sequences of length one
(for a batch of one that view needs no copy) and the module is called with an
array offset, one position per sequence, which `mx.fast.rope` applies per batch
row. So the module's own math runs (plain, traditional, linear, Llama3, YaRN,
phi3 longrope/SuScaled with its input scale, partial rotary) and a layer costs
what a dense layer costs.

A RoPE that cannot take per-token positions that way falls back to one call per
contiguous run of kept tokens (each with the run's start as offset), and says so:
a log warning once per module, and `rope_fallbacks()` lists them. Dynamic NTK
(whose base depends on the sequence length) takes per-token positions while every
position is inside its `max_position_embeddings` (its base is then constant) and
falls back per run beyond. Modules of unknown classes are probed once against
per-run calls before per-token positions are trusted.

After prefill, decode calls use `offset + shift` so they land at M, not N.

mlx-vlm models with multi-axis RoPE have no `rope` to wrap: sparse prefill hands them
explicit `position_ids`, and decode positions come from cache offset + the model's
`_rope_deltas`, which we set to the shift for each call and clear afterwards.
"""

import logging
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapters import position_carrier, rope_owners, takes_position_ids

logger = logging.getLogger(__name__)

Runs = Sequence[tuple[int, int]]


def position_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted positions into (start, length) runs of consecutive values."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [positions.size]])
    return [(int(positions[s]), int(e - s)) for s, e in zip(starts, ends)]


def runs_to_positions(runs: Runs) -> np.ndarray:
    """The per-token positions that (start, length) runs cover, in order."""
    if not runs:
        return np.zeros(0, dtype=np.int32)
    starts, lengths = np.asarray(runs, dtype=np.int64).reshape(-1, 2).T
    before = np.cumsum(lengths) - lengths  # tokens ahead of each run
    return (np.repeat(starts - before, lengths) + np.arange(lengths.sum())).astype(np.int32)


# which rope modules take per-token positions ---------------------------------------

def _trusted_classes() -> tuple:
    """RoPE classes whose call hands `offset` to `mx.fast.rope` unchanged (read from
    their source; the exactness tests cover each): per-token positions need no probe."""
    classes = [nn.RoPE]
    try:
        from mlx_lm.models import rope_utils
    except ImportError:  # pragma: no cover
        return tuple(classes)
    for name in ("SuScaledRoPE", "Llama3RoPE", "YarnRoPE", "ProportionalRoPE"):
        if hasattr(rope_utils, name):
            classes.append(getattr(rope_utils, name))
    return tuple(classes)


def _is_dynamic_ntk(rope: nn.Module) -> bool:
    return type(rope).__name__ == "DynamicNTKScalingRoPE" and all(
        hasattr(rope, a) for a in ("dims", "base", "traditional", "max_position_embeddings"))


_TRUSTED = _trusted_classes()
# id(module) -> (weakref to it, per-token verdict, reason); filled on first use
_VERDICTS: dict[int, tuple] = {}
_FALLBACKS: dict[int, tuple] = {}  # id -> (weakref, description) of modules run per run


def _per_token_call(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """Rotate x (batch, heads, N, dim) with token i at positions[i], in one call."""
    batch, heads, length, dim = x.shape
    if batch == 1:
        rows = x.swapaxes(0, 2)  # (N, heads, 1, dim): N sequences of length one
    else:
        rows = x.transpose(2, 0, 1, 3).reshape(length, batch * heads, 1, dim)
    if _is_dynamic_ntk(rope):
        rotated = mx.fast.rope(rows, rope.dims, traditional=rope.traditional, base=rope.base,
                               scale=1.0, offset=positions)
    else:
        rotated = rope(rows, offset=positions)
    if batch == 1:
        return rotated.swapaxes(0, 2)
    return rotated.reshape(length, batch, heads, dim).transpose(1, 2, 0, 3)


def _per_run_call(rope: nn.Module, x: mx.array, runs: Runs) -> mx.array:
    parts, start = [], 0
    for position, length in runs:
        parts.append(rope(x[..., start : start + length, :], offset=position))
        start += length
    return mx.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]


def _probe(rope: nn.Module, dim: int) -> tuple[bool, str]:
    """Per-token call against per-run calls on a small input; (agrees, reason)."""
    runs = [(0, 3), (9, 2), (300, 1), (1000, 2)]
    x = mx.random.normal((1, 2, 8, dim), key=mx.random.key(0))
    try:
        fast = _per_token_call(rope, x, mx.array(runs_to_positions(runs)))
        slow = _per_run_call(rope, x, runs)
        error = mx.abs(fast - slow).max().item()
    except Exception as exc:  # any failure: the module cannot take array offsets
        return False, f"per-token call failed ({type(exc).__name__}: {exc})"
    scale = max(mx.abs(slow).max().item(), 1.0)
    if not error <= 1e-5 * scale:
        return False, f"per-token positions differ from per-run calls by {error:.3g}"
    return True, "probed"


def _remember(table: dict, module: nn.Module, value) -> None:
    key = id(module)
    table[key] = (weakref.ref(module, lambda _, key=key: table.pop(key, None)), value)


def _recall(table: dict, module: nn.Module):
    entry = table.get(id(module))
    return entry[1] if entry is not None and entry[0]() is module else None


def per_token_support(rope: nn.Module, dim: int, max_position: int) -> tuple[bool, str]:
    """Whether `rope` can rotate tokens at arbitrary per-token positions in one call
    (exactly as per-run calls would), and why not."""
    if _is_dynamic_ntk(rope):
        if max_position < rope.max_position_embeddings:
            return True, "dynamic NTK within max_position_embeddings (constant base)"
        return False, (f"dynamic NTK beyond max_position_embeddings "
                       f"({max_position} >= {rope.max_position_embeddings}): its base depends "
                       "on the sequence length")
    if type(rope) in _TRUSTED:
        return True, "known class"
    verdict = _recall(_VERDICTS, rope)
    if verdict is None:
        verdict = _probe(rope, dim)
        _remember(_VERDICTS, rope, verdict)
    return verdict


def _note_fallback(rope: nn.Module, reason: str) -> None:
    if _recall(_FALLBACKS, rope) is None:
        logger.warning("RoPE %s: kept tokens rotated one run at a time (slower): %s",
                       type(rope).__name__, reason)
        _remember(_FALLBACKS, rope, f"{type(rope).__name__}: {reason}")


def rope_fallbacks(model: Optional[nn.Module] = None) -> list[str]:
    """Which RoPE modules (of `model`, or any seen) sparse prefill had to run one call per
    run of kept tokens instead of one per layer, with the reason; empty when none."""
    if model is None:
        return sorted({v for _, (ref, v) in list(_FALLBACKS.items()) if ref() is not None})
    found = []
    for owner in rope_owners(model):
        rope = owner["rope"]
        rope = rope.inner if isinstance(rope, PositionedRoPE) else rope
        description = _recall(_FALLBACKS, rope)
        if description is not None and description not in found:
            found.append(description)
    return found


class Placement:
    """Where one forward's tokens sit, shared by all of a model's wrappers: at per-token
    positions (`runs`, turned into one positions array for every layer), or at each
    cache's offset + `shift`."""

    def __init__(self):
        self.set(None, 0)

    def set(self, runs: Optional[Runs], shift: int) -> None:
        self.runs, self.shift = runs, shift
        self.positions, self.count, self.largest = None, 0, 0
        if runs is not None:
            positions = runs_to_positions(runs)
            self.count = int(positions.size)
            self.largest = int(positions.max()) if positions.size else 0
            self.positions = mx.array(positions)


class PositionedRoPE(nn.Module):
    """Calls `inner` where its `placement` says: per-token positions, or `offset + shift`."""

    def __init__(self, inner: nn.Module, placement: Placement):
        super().__init__()
        self.inner = inner
        self.placement = placement

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        place = self.placement
        runs = place.runs
        if runs is None:
            return self.inner(x, offset=offset + place.shift)
        if place.count != x.shape[-2]:
            raise ValueError(f"runs cover {place.count} tokens, input has {x.shape[-2]}")
        if len(runs) == 1:
            return self.inner(x, offset=runs[0][0])
        if x.ndim == 4:
            ok, reason = per_token_support(self.inner, x.shape[-1], place.largest)
            if ok:
                return _per_token_call(self.inner, x, place.positions)
        else:
            reason = f"input of rank {x.ndim}, not (batch, heads, tokens, dim)"
        _note_fallback(self.inner, reason)
        return _per_run_call(self.inner, x, runs)


# id(model) -> (weakref, (Placement, [(attention module, its wrapper)])): made once, so a
# decode step that moves positions puts wrappers in place without building any
_WRAPPERS: dict[int, tuple] = {}


def _wrappers(model: nn.Module) -> tuple[Placement, list]:
    known = _recall(_WRAPPERS, model)
    if known is not None and all(owner["rope"] is wrapper or owner["rope"] is wrapper.inner
                                 for owner, wrapper in known[1]):
        return known
    placement, pairs = Placement(), []
    for owner in rope_owners(model):
        rope = owner["rope"]
        inner = rope.inner if isinstance(rope, PositionedRoPE) else rope
        pairs.append((owner, PositionedRoPE(inner, placement)))
    _remember(_WRAPPERS, model, (placement, pairs))
    return placement, pairs


def install_rope(model: nn.Module, runs: Optional[Runs] = None, shift: int = 0) -> None:
    """Wrap every attention layer's rope (the model's wrappers, made on first use); on a
    position_ids model, set the decode carrier instead."""
    if takes_position_ids(model):
        carrier = position_carrier(model)
        carrier._rope_deltas = mx.array([[shift]], dtype=mx.int32)
        carrier._position_ids = None
        return
    if runs is None and shift == 0:
        cleanup_rope(model)  # the model's own RoPE is already right
        return
    placement, pairs = _wrappers(model)
    placement.set(runs, shift)
    for owner, wrapper in pairs:
        if owner["rope"] is not wrapper:
            owner.rope = wrapper


def cleanup_rope(model: nn.Module) -> None:
    """Remove every PositionedRoPE (or clear the position_ids model's carrier, as
    mlx-vlm itself does for a new image): the model is as it was loaded."""
    if takes_position_ids(model):
        carrier = position_carrier(model)
        carrier._rope_deltas = None
        carrier._position_ids = None
        return
    known = _recall(_WRAPPERS, model)
    owners = [owner for owner, _ in known[1]] if known is not None else rope_owners(model)
    for owner in owners:
        rope = owner["rope"]
        if isinstance(rope, PositionedRoPE):
            owner.rope = rope.inner


@contextmanager
def positioned_rope(
    model: nn.Module, runs: Optional[Runs] = None, shift: int = 0
) -> Iterator[None]:
    """Wrap for one forward call, and always unwrap afterwards.

    MLX builds its graph when the module is called, so unwrapping right after the
    call (before evaluation) is safe.
    """
    install_rope(model, runs, shift)
    try:
        yield
    finally:
        cleanup_rope(model)
