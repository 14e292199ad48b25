"""When SpecPrefill pays: predict both prefills from the models' shapes, refined by the
prefills the engine runs anyway. No timed prefill runs on a request's path.

A prefill of L tokens after C cached entries costs W = 2 * parameters * L FLOPs in the
weights and A = 4 * layers * heads * head_dim * (L*C + L^2/2) in attention. Its time is
fit per model as t = a*W + b*A (least squares, a, b >= 0) over that model's recent
prefills (every scoring and target prefill adds one, but a process's first of each
model, which pays one-time costs: kernel compiles on a GPU, buffer allocations). Until a model has prefills of two
lengths, both terms share one rate (its observed seconds per FLOP, or the other model's,
or, before anything ran, any: then only the FLOP ratio decides). So a process's first
request is decided from the shapes, and the fits take over as requests run. The
observations persist per (target, draft, device) in the user's cache directory
(`cache_dir()`), so a new process starts from the last one's fits.

SpecPrefill is engaged when the predicted dense time exceeds the predicted SpecPrefill
time (the draft on what its prefix cache lacks + the target on the kept tokens) by
more than `margin`.
"""

import hashlib
import json
import logging
import platform
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..loading import cache_dir

logger = logging.getLogger(__name__)
HISTORY = 32  # observations kept per model


@dataclass(frozen=True)
class Shape:
    """What a prefill's FLOPs depend on."""

    parameters: int  # outside the embedding
    attention: int  # layers * heads * head_dim of the attention layers (0: unknown)

    def flops(self, tokens: int, cached: int) -> tuple[float, float]:
        weights = 2.0 * self.parameters * tokens
        attention = 4.0 * self.attention * (tokens * cached + tokens * tokens / 2)
        return weights, attention


def shape_of(model: nn.Module) -> Shape:
    """Parameters from the weights themselves (every architecture, quantized too;
    embeddings left out); attention width from the config where it says (hybrids
    count all layers, an overestimate)."""
    total = 0
    for _, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            continue
        for name, value in module.parameters().items():
            if isinstance(value, mx.array) and name not in ("scales", "biases"):
                bits = getattr(module, "bits", None) if value.dtype == mx.uint32 else None
                total += value.size * (32 // bits if bits else 1)
    args = getattr(model, "args", None)
    layers = getattr(args, "num_hidden_layers", 0) or 0
    heads = getattr(args, "num_attention_heads", 0) or 0
    hidden = getattr(args, "hidden_size", 0) or 0
    head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads else 0)
    return Shape(int(total), int(layers * heads * head_dim))


def _fit(points, shape: Shape) -> Optional[tuple[float, float]]:
    """(a, b) for t = a*W + b*A, or None with fewer than two distinct lengths."""
    if len({(p[0], p[1]) for p in points}) < 2:
        return None
    design = np.array([shape.flops(tokens, cached) for tokens, cached, _ in points])
    times = np.array([p[2] for p in points], dtype=np.float64)
    if not design[:, 1].any():
        return float(times.sum() / design[:, 0].sum()), 0.0
    (a, b), *_ = np.linalg.lstsq(design, times, rcond=None)
    if a < 0 or b < 0:  # one term alone
        rate = float(times.sum() / design.sum())
        return rate, rate
    return float(a), float(b)


@dataclass
class CostModel:
    target_shape: Shape
    draft_shape: Optional[Shape] = None
    target: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    draft: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    path: Optional[Path] = None  # where the observations persist
    warm: set = field(default_factory=set)  # models whose first prefill has been seen

    def observe(self, which: str, tokens: int, cached: int, seconds: float) -> None:
        if which not in self.warm:  # a process's first prefill of a model pays one-time costs
            self.warm.add(which)
            return
        if tokens > 0 and seconds > 0:
            getattr(self, which).append((int(tokens), int(cached), float(seconds)))

    def _rate(self, which: str) -> Optional[float]:
        """Observed seconds per FLOP of a model, over all its prefills."""
        points = getattr(self, which)
        shape = self.target_shape if which == "target" else self.draft_shape
        if not points:
            return None
        flops = sum(sum(shape.flops(tokens, cached)) for tokens, cached, _ in points)
        return sum(p[2] for p in points) / max(flops, 1.0)

    def predict(self, which: str, tokens: int, cached: int = 0) -> float:
        shape = self.target_shape if which == "target" else self.draft_shape
        weights, attention = shape.flops(tokens, cached)
        fit = _fit(getattr(self, which), shape)
        if fit is not None:
            return fit[0] * weights + fit[1] * attention
        other = "draft" if which == "target" else "target"
        rate = self._rate(which) or self._rate(other) or 1e-12
        return rate * (weights + attention)

    def load(self) -> None:
        try:
            saved = json.loads(self.path.read_text())
            for which in ("target", "draft"):
                getattr(self, which).extend(tuple(p) for p in saved.get(which, []))
        except (OSError, ValueError, TypeError):
            pass  # nothing saved yet, or unreadable: start from the shapes

    def save(self) -> None:
        if self.path is None or not (self.target or self.draft):
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"target": list(self.target),
                                             "draft": list(self.draft)}))
        except OSError as error:
            logger.info("could not save prefill costs to %s: %r", self.path, error)


def cost_model(target: nn.Module, draft: Optional[nn.Module], key: tuple) -> CostModel:
    """A cost model for this pair on this machine, with what earlier processes saw."""
    name = json.dumps([*map(str, key), str(mx.default_device()), platform.node()])
    path = cache_dir() / "costs" / f"{hashlib.sha1(name.encode()).hexdigest()[:16]}.json"
    costs = CostModel(shape_of(target), shape_of(draft) if draft is not None else None,
                      path=path)
    costs.load()
    return costs


@dataclass(frozen=True)
class Prediction:
    dense_s: float
    specprefill_s: float

    @property
    def gain(self) -> float:
        return self.dense_s / max(self.specprefill_s, 1e-12)

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
    dense = costs.predict("target", prompt_tokens - dense_cached, dense_cached)
    sparse = costs.predict("draft", prompt_tokens - draft_cached, draft_cached) + \
        costs.predict("target", kept_tokens)
    return Prediction(dense, sparse)


def expected_kept(prompt_tokens: int, keep: float, protected: Optional[np.ndarray],
                  chunk_size: int, tail_tokens: int) -> int:
    """About what selection will keep: protected tokens, then keep of the rest."""
    forced = int(protected.sum()) if protected is not None else 0
    rest = prompt_tokens - forced
    return min(prompt_tokens, forced + max(int(np.ceil(keep * rest)), chunk_size + tail_tokens))
