"""Give kept tokens their original RoPE positions by wrapping the model's RoPE.

During sparse prefill the cache offset counts kept tokens (N), not prompt
positions. `PositionedRoPE` replaces each attention layer's `rope` for one forward
and calls the ORIGINAL module once per contiguous run of kept tokens with that
run's true start as the offset. Any RoPE variant (plain, traditional, Llama3, YaRN,
longrope, partial rotary, dynamic NTK) stays exact because its own math runs.
After prefill, decode calls use `offset + shift` so they land at M, not N.

mlx-vlm models with multi-axis RoPE have no `rope` to wrap: sparse prefill hands them
explicit `position_ids`, and decode positions come from cache offset + the model's
`_rope_deltas`, which we set to the shift for each call and clear afterwards.
"""

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapters import position_carrier, rope_owners, takes_position_ids

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


class PositionedRoPE(nn.Module):
    """Calls `inner` at explicit runs of positions, or at `offset + shift`."""

    def __init__(self, inner: nn.Module, runs: Optional[Runs] = None, shift: int = 0):
        super().__init__()
        self.inner = inner
        self.runs = runs
        self.shift = shift

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if self.runs is None:
            return self.inner(x, offset=offset + self.shift)
        parts, start = [], 0
        for position, length in self.runs:
            parts.append(self.inner(x[..., start : start + length, :], offset=position))
            start += length
        if start != x.shape[-2]:
            raise ValueError(f"runs cover {start} tokens, input has {x.shape[-2]}")
        return mx.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]


def install_rope(model: nn.Module, runs: Optional[Runs] = None, shift: int = 0) -> None:
    """Wrap every attention layer's rope (re-using wrappers already there); on a
    position_ids model, set the decode carrier instead."""
    if takes_position_ids(model):
        carrier = position_carrier(model)
        carrier._rope_deltas = mx.array([[shift]], dtype=mx.int32)
        carrier._position_ids = None
        return
    if runs is None and shift == 0:
        cleanup_rope(model)  # the model's own RoPE is already right
        return
    for owner in rope_owners(model):
        rope = owner["rope"]
        if isinstance(rope, PositionedRoPE):
            rope.runs, rope.shift = runs, shift
        else:
            owner.rope = PositionedRoPE(rope, runs, shift)


def cleanup_rope(model: nn.Module) -> None:
    """Remove every PositionedRoPE (or clear the position_ids model's carrier, as
    mlx-vlm itself does for a new image): the model is as it was loaded."""
    if takes_position_ids(model):
        carrier = position_carrier(model)
        carrier._rope_deltas = None
        carrier._position_ids = None
        return
    for owner in rope_owners(model):
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
