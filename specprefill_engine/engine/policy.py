"""When SpecPrefill pays: predict both prefills from costs measured on this machine.

Prefill time of L tokens is modelled as a*L + b*L^2 (weights and attention), one
model for the target and one for the draft's scoring. The first request that needs
a prediction runs a short calibration (two prefills of each model at lengths sized
for the device); every prefill the engine then does adds an observation, and the
fits are refreshed from the most recent ones. SpecPrefill is engaged when the
predicted dense time exceeds the predicted SpecPrefill time (draft scoring of the
uncached tokens + target prefill of the kept ones) by more than `margin`.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..core.prefill import chunked_prefill

HISTORY = 32  # observations kept per model


def _fit(points) -> tuple[float, float]:
    """Least squares a, b >= 0 for t = a*L + b*L^2."""
    lengths = np.array([p[0] for p in points], dtype=np.float64)
    times = np.array([p[1] for p in points], dtype=np.float64)
    design = np.stack([lengths, lengths**2], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, times, rcond=None)
    if b < 0:
        a, b = float(times.sum() / lengths.sum()), 0.0
    if a < 0:
        a, b = 0.0, float(times @ lengths**2 / (lengths**4).sum())
    return float(a), float(b)


@dataclass
class CostModel:
    target: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    draft: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    calibrated: bool = False

    def observe(self, which: str, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            getattr(self, which).append((tokens, seconds))

    def predict(self, which: str, tokens: int) -> float:
        a, b = _fit(getattr(self, which))
        return a * tokens + b * tokens * tokens

    def calibrate(self, target, draft, step_size: int, draft_step_size: int) -> None:
        """Two timed prefills of each model, on this worker; each length runs twice and
        the second is kept (a GPU compiles kernels for a shape's first call)."""
        lengths = (256, 768) if mx.default_device() == mx.cpu else (2048, 8192)
        for which, model, step in (("target", target, step_size),
                                   ("draft", draft, draft_step_size)):
            if model is None:  # a follower rank calibrates its target shard only
                continue
            balanced = None if which == "target" else False  # as the engine prefills each
            for length in lengths:
                _timed_prefill(model, length, step, balanced)
                self.observe(which, length, _timed_prefill(model, length, step, balanced))
        self.calibrated = True


def _timed_prefill(model, length: int, step_size: int, balanced: Optional[bool]) -> float:
    tokens = mx.array(np.arange(length) % 1000 + 10, dtype=mx.int32)
    cache = make_prompt_cache(model)
    mx.synchronize()
    started = time.perf_counter()
    for _ in chunked_prefill(model, tokens, cache, step_size, want_logits=False,
                             balanced=balanced):
        pass
    mx.synchronize()
    return time.perf_counter() - started


@dataclass(frozen=True)
class Prediction:
    dense_s: float
    specprefill_s: float

    @property
    def gain(self) -> float:
        return self.dense_s / max(self.specprefill_s, 1e-9)

    def pays(self, margin: float) -> bool:
        """SpecPrefill is worth engaging: the predicted gain beats 1 + margin."""
        return self.gain >= 1 + margin

    def describe(self) -> str:
        return (f"predicted {self.gain:.2f}x: dense {self.dense_s:.3f}s, "
                f"SpecPrefill {self.specprefill_s:.3f}s")


def predict(costs: CostModel, prompt_tokens: int, dense_cached: int, draft_cached: int,
            kept_tokens: int) -> Prediction:
    """Dense: the target on what its prefix cache lacks. SpecPrefill: the draft on
    what its prefix cache lacks, then the target on the kept tokens."""
    dense = costs.predict("target", prompt_tokens - dense_cached)
    sparse = costs.predict("draft", prompt_tokens - draft_cached) + \
        costs.predict("target", kept_tokens)
    return Prediction(dense, sparse)


def expected_kept(prompt_tokens: int, keep: float, protected: Optional[np.ndarray],
                  chunk_size: int, tail_tokens: int) -> int:
    """About what selection will keep: protected tokens, then keep of the rest."""
    forced = int(protected.sum()) if protected is not None else 0
    rest = prompt_tokens - forced
    return min(prompt_tokens, forced + max(int(np.ceil(keep * rest)), chunk_size + tail_tokens))
