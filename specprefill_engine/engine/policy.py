"""When SpecPrefill pays: predict both prefills from the models' shapes, refined by the
prefills the engine runs anyway. No timed prefill runs on a request's path.

A prefill of L tokens after C cached entries costs W = 2 * parameters * L FLOPs in the
weights, N = 4 * layers * heads * head_dim * L^2/2 in attention among its own tokens and
K = 4 * layers * heads * head_dim * L*C in attention over the cached entries, plus a
fixed cost per call (kernel launches, sampling, the scoring step's lookahead and
importance). The two attentions run at different rates per FLOP: a prompt's own tokens
attend in large blocks, while an agent's next turn (a few hundred tokens after tens of
thousands cached) reads the whole cache for few queries, bound by memory; with a rate
each, many short turns over a long cache cannot set the rate of a long prompt's own
attention. The time is fit per model as t = c + a*W + b*N + d*K, d >= b, over that
model's recent prefills:
- on relative errors, so a 1-token prefill and a 32K one count alike; the fixed cost c
  explains what a few-token prefill takes, so such a prefill cannot set the FLOP rates;
- robustly: each point's weight falls with its distance from the fit in log time
  (Huber), so an outlier (a kernel compiled for a new shape) barely moves it, and older
  points weigh less until they age out (`HISTORY` points, `MAX_AGE_S`);
- with a weak prior: every rate equal to the model's own seconds per FLOP over its
  longer prefills, else the other model's, else any (then only the FLOP ratio decides),
  and no fixed cost; it decides what the points leave open (a model seen at one length)
  and fades as long prefills are measured; attention's rate never below a quarter of
  that prior (`ATTENTION_SLACK`; of the lower bound below, for the model it bounds), so
  points of few lengths cannot price a longer prompt's quadratic attention at nothing;
- with each rate bounded by the other model's measured one: per FLOP, the smaller
  model is between `RATE_BOUNDS` times the larger's (small models use a device less
  well, never a thousand times less).
A process's first prefill of each model counts only where it was faster than predicted
(it pays one-time costs, kernel compiles on a GPU and buffer allocations, which only slow
it; a faster one says the belief was too pessimistic).

SpecPrefill is engaged when the predicted dense time exceeds the predicted SpecPrefill
time (the draft on what its prefix cache lacks + the target on the kept tokens) by
more than `margin`, and by more than the conversation's debt. A conversation's next turn
continues a dense turn from its whole cache, but a SpecPrefill turn from a sparse view,
which it extends, repairs or selects anew, unless the view was densified while the
conversation was idle; and a turn that selects anew leaves a view of its own, so without
idle time every later turn of the conversation pays. The debt is what the later turns
of a conversation that engages now are expected to pay beyond dense continuations:
- what one later turn pays: every turn that continues a stored turn's sparse view
  ("followup") is measured, its prefill and scoring against a dense continuation's
  predicted time, at most a dense prefill of its whole prompt (what ending the chain
  costs), per token of the turn it followed; the mean over those measured. A turn that
  found its view densified is not one: it paid nothing only because its conversation
  was idle long enough, which the first turn cannot know, so the debt is what later
  turns pay when the agent's tool returns at once (a mean over both let a loop without
  idle time engage on the strength of other conversations' idle time, and lose);
- how many later turns a conversation has: every stored turn of a prompt the policy
  weighs, dense or SpecPrefill, is counted ("turns": whether it continued a stored
  turn), and the later turns per conversation are those that continued one per one
  that continued none; a single request is a conversation without later turns;
so the debt of engaging on a prompt of L tokens is that mean extra per token times L
times the later turns per conversation, bounded by the dense prefill that would end the
chain. Until a follow-up is measured it is 0.

A policy that declines where the shapes alone predict a large gain (`RECHECK_GAIN`)
that would also beat the debt engages now and then anyway, at growing intervals, so a
wrong fit is measured and corrected instead of locking itself in (`Recheck`).

A repair (`planner.py`) feeds a stored sparse view's dropped passages after entries of
later positions: its forwards attend through a mask by position, which may cost about
what a causal forward costs (a CPU) or several times more (a GPU whose fused attention
takes only causal masks). So a repaired prefill is its own kind ("repair"): its cost is
the target's fit times the median ratio of the repaired prefills measured to that fit
(1 until one is), and it never enters the target's own points.

The points persist per (target, draft, device) in the user's cache directory
(`cache_dir()/costs`, versioned, with the models' shapes); a file that cannot be read,
is of another version or shape, or holds implausible points is dropped (point by point
where it can be) with a log line. Deleting the folder clears them.
"""

import hashlib
import itertools
import json
import logging
import math
import platform
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..loading import cache_dir, save_json

logger = logging.getLogger(__name__)
VERSION = 2  # of the persisted file
HISTORY = 64  # points kept per model
HALF_LIFE = 32  # points: a point this many observations old weighs half
MAX_AGE_S = 30 * 86400  # persisted points older than this are dropped
LONG = 256  # tokens: a prefill long enough for its FLOPs to dominate its fixed cost
RATE_BOUNDS = (0.5, 32.0)  # the smaller model's seconds per FLOP / the larger's
ATTENTION_SLACK = 4.0  # attention's rate may stray this much further (other kernels)
PRIOR_WEIGHT = 0.05  # of each prior point, against 1 for a measured one (less as long
# prefills are measured)
HUBER = 0.3  # log-time distance beyond which a point's weight falls
RECHECK_GAIN = 2.0  # shapes predicting at least this gain make a decline re-checked
RECHECK_MAX = 64  # the longest interval between re-checks, in declines
_PRIOR_PREFILLS = ((512, 0), (4096, 0), (4096, 4096))  # (tokens, cached) the prior speaks of
_PLAUSIBLE_RATE = (1e-17, 1e-5)  # seconds per FLOP of a long prefill on any machine
_MAX_SECONDS = 3600.0


@dataclass(frozen=True)
class Shape:
    """What a prefill's FLOPs depend on."""

    parameters: int  # outside the embedding
    attention: int  # layers * heads * head_dim of the attention layers (0: unknown)

    def flops(self, tokens: int, cached: int) -> tuple[float, float, float]:
        """In the weights, in attention among the new tokens, over the cached entries."""
        weights = 2.0 * self.parameters * tokens
        own = 4.0 * self.attention * tokens * tokens / 2
        return weights, own, 4.0 * self.attention * tokens * cached


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


@dataclass(frozen=True)
class Law:
    """t = fixed + weights_rate * W + attention_rate * N + cached_rate * K, in seconds."""

    fixed: float
    weights_rate: float
    attention_rate: float
    cached_rate: float

    def seconds(self, shape: Shape, tokens: int, cached: int) -> float:
        weights, own, over_cache = shape.flops(tokens, cached)
        return (self.fixed + self.weights_rate * weights + self.attention_rate * own
                + self.cached_rate * over_cache)


def _box_least_squares(design: np.ndarray, target: np.ndarray, lower: np.ndarray,
                       upper: np.ndarray) -> Optional[np.ndarray]:
    """argmin |design x - target|^2 with lower <= x <= upper, for a few unknowns: the
    optimum has each unknown free or at one of its bounds, so every such case is solved
    (at once, on the normal equations of unit-norm columns) and the best feasible one
    kept."""
    n = design.shape[1]
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    unit = design / norms
    low, high = lower * norms, upper * norms  # the bounds of y = x * norms
    gram, moment = unit.T @ unit, unit.T @ target
    cases = np.array(list(itertools.product((0, 1, 2), repeat=n)))  # free, lower, upper
    free = cases == 0
    ends = np.stack([np.zeros(n), low, high])[cases, np.arange(n)]
    usable = np.all(np.isfinite(ends), axis=1) & ~np.any((cases == 2) & (low == high), axis=1)
    ends = np.where(np.isfinite(ends), ends, 0.0)
    # a free unknown's row is its normal equation; a held one's says y_i = its bound
    system = np.where(free[:, :, None], gram, np.eye(n))
    y = np.einsum("kij,kj->ki", np.linalg.pinv(system), np.where(free, moment, ends))
    y = np.where(free, y, ends)
    feasible = usable & np.all(y >= low - 1e-12 * (1 + np.abs(low)), axis=1) & \
        np.all(y <= high + 1e-9 * (1 + np.abs(high)), axis=1)
    if not feasible.any():
        return None
    cost = np.sum((y @ unit.T - target) ** 2, axis=1)
    best = y[np.flatnonzero(feasible)[np.argmin(cost[feasible])]]
    return np.clip(best / norms, lower, upper)


def fit(shape: Shape, points, prior_rate: float,
        bounds: Optional[tuple[float, float]] = None) -> Law:
    """The robust, prior-anchored fit of t = c + a*W + b*N + d*K described in the module
    docstring, with d = b + e, e >= 0: attention over a cache costs at least what the
    new tokens' attention among themselves does per FLOP, and the points show how much
    more (without them, the prior). `points`: (tokens, cached, seconds), oldest first;
    `bounds`: for the weights' rate (b gets `ATTENTION_SLACK` more room each way, and e
    up to that upper bound again)."""
    prior = [(tokens, cached, prior_rate * sum(shape.flops(tokens, cached)))
             for tokens, cached in _PRIOR_PREFILLS]
    rows = np.array([(1.0, w, own + over_cache, over_cache) for w, own, over_cache in
                     (shape.flops(t, c) for t, c, _ in [*points, *prior])])
    times = np.array([s for _, _, s in [*points, *prior]], dtype=np.float64)
    ages = np.arange(len(points))[::-1]
    long = sum(tokens >= LONG for tokens, _, _ in points)
    base = np.concatenate([0.5 ** (ages / HALF_LIFE),
                           np.full(len(prior), PRIOR_WEIGHT / (1 + long))])
    scale = np.maximum(np.abs(rows).max(axis=0), 1e-300)
    scaled = rows / scale / times[:, None]  # relative residuals
    lower, upper = np.zeros(4), np.full(4, np.inf)
    # the fixed cost is at most what a short prefill took (the median of those seen),
    # else what a short one would take at the prior rate
    short = [seconds for tokens, _, seconds in points if tokens < LONG]
    upper[0] = float(np.median(short)) if short else prior_rate * sum(shape.flops(LONG, 0))
    lower[2] = prior_rate / ATTENTION_SLACK
    if bounds is not None:  # fewer long prefills than the other model: its prior may be
        # one bad point's, so the other's rate sets the floors
        lower[1:3] = bounds[0], bounds[0] / ATTENTION_SLACK
        upper[1:] = bounds[1], bounds[1] * ATTENTION_SLACK, bounds[1] * ATTENTION_SLACK
    if not rows[:, 2].any():  # no attention width known: its rates are moot
        upper[2:] = lower[2:] = 0.0
    weights = base.copy()
    x = np.array([0.0, prior_rate, prior_rate, 0.0])
    for _ in range(6):
        root = np.sqrt(weights)[:, None]
        solved = _box_least_squares(scaled * root, root[:, 0], lower * scale, upper * scale)
        if solved is None:
            break
        x = solved / scale
        predicted = np.maximum(rows @ x, 1e-12)
        distance = np.abs(np.log(predicted / times))
        weights = base * np.minimum(1.0, HUBER / np.maximum(distance, 1e-12))
    return Law(float(x[0]), float(x[1]), float(x[2]), float(x[2] + x[3]))


@dataclass
class Recheck:
    """When a decline against the shapes' prediction engages anyway: the `interval`-th
    such decline does, and each re-check doubles the interval (up to `RECHECK_MAX`)
    until the policy engages by itself again."""

    interval: int = 2
    declines: int = 0

    def due(self) -> bool:
        self.declines += 1
        if self.declines < self.interval:
            return False
        self.declines, self.interval = 0, min(2 * self.interval, RECHECK_MAX)
        return True

    def engaged(self) -> None:
        self.interval, self.declines = Recheck.interval, 0


@dataclass
class CostModel:
    target_shape: Shape
    draft_shape: Optional[Shape] = None
    target: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    draft: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    repair: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # the target's
    followup: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # the target's
    turns: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # the target's
    path: Optional[Path] = None  # where the observations persist
    warm: set = field(default_factory=set)  # models whose first prefill has been seen
    recheck: Recheck = field(default_factory=Recheck)
    _laws: dict = field(default_factory=dict)  # fits, until the next observation

    def shape(self, which: str) -> Shape:
        return self.draft_shape if which == "draft" else self.target_shape

    def observe(self, which: str, tokens: int, cached: int, seconds: float) -> None:
        """A measured prefill ("target", "draft" or "repair", the target's). A process's
        first of each model pays one-time costs, which only make it slower: it counts
        only where it was faster than predicted."""
        model = "target" if which == "repair" else which
        if model not in self.warm:
            self.warm.add(model)
            if seconds >= self.predict(which, tokens, cached):
                return
        if _record(getattr(self, which), tokens, cached, seconds):
            self._laws.clear()

    def observe_followup(self, tokens: int, cached: int, seconds: float) -> None:
        """A turn that continued a stored turn's sparse view of `cached` tokens with
        `tokens` more: its prefill and scoring took `seconds`."""
        _record(self.followup, tokens, cached, seconds)

    def observe_turn(self, tokens: int, continued: int, seconds: float) -> None:
        """A stored turn of `tokens`, dense or SpecPrefill; `continued`: the length of the
        stored turn it continued (0: it starts a conversation)."""
        _record(self.turns, tokens, continued, seconds)

    def later_turns(self) -> float:
        """The later turns a conversation has had on average: the turns that continued a
        stored turn per turn that continued none (0 before any)."""
        starts = sum(continued == 0 for _, continued, *_ in self.turns)
        return (len(self.turns) - starts) / max(starts, 1)

    def extra(self) -> Optional[float]:
        """What a later turn of a SpecPrefill conversation paid beyond a dense
        continuation, per token of the turn it followed: the mean over the follow-ups,
        each at most a dense prefill of its whole prompt (None before any)."""
        extra = [min(max(seconds - self.predict("target", new, cached), 0.0),
                     self.predict("target", new + cached)) / cached
                 for new, cached, seconds, _ in self.followup if cached > 0]
        return float(np.mean(extra)) if extra else None

    def debt(self, tokens: int) -> float:
        """What engaging on a prompt of `tokens` is expected to cost the conversation's
        later turns: the mean extra per token a later turn paid (`extra`) times `tokens`
        times the later turns per conversation (`later_turns`); 0 before any follow-up."""
        extra = self.extra()
        if extra is None or not self.measured():  # a follow-up of no stored turn says nothing
            return 0.0
        return tokens * extra * self.later_turns()

    def _rate(self, which: str) -> Optional[float]:
        """A model's seconds per FLOP over its long prefills (the median), if any."""
        shape = self.shape(which)
        rates = [seconds / sum(shape.flops(tokens, cached))
                 for tokens, cached, seconds, _ in getattr(self, which) if tokens >= LONG]
        return float(np.median(rates)) if rates else None

    def measured(self) -> bool:
        """Whether a long prefill of either model was measured: before that, predictions
        are in the prior's units (only their ratios mean anything)."""
        return bool(self._long("target") or (self.draft_shape is not None and self._long("draft")))

    def _long(self, which: str) -> int:
        return sum(tokens >= LONG for tokens, *_ in getattr(self, which))

    def law(self, which: str) -> Law:
        """The model's fit; the one with fewer long prefills measured (the draft on a tie)
        is bounded by the other's rate, so a bad point cannot spread from one to both."""
        if which not in self._laws:
            other = "draft" if which == "target" else "target"
            own, theirs = self._rate(which), None
            if self.draft_shape is not None:
                theirs = self._rate(other)
            prior = own or theirs or 1e-12
            bounds = None
            if theirs is not None and self._long(which) <= self._long(other) and \
                    (which == "draft" or self._long(which) < self._long(other)):
                low, high = RATE_BOUNDS
                if self.shape(which).parameters > self.shape(other).parameters:
                    low, high = 1 / high, 1 / low
                bounds = (theirs * low, theirs * high)
                prior = min(max(prior, bounds[0]), bounds[1])
            points = [p[:3] for p in getattr(self, which)]
            self._laws[which] = fit(self.shape(which), points, prior, bounds) if points \
                else Law(0.0, prior, prior, prior)
        return self._laws[which]

    def predict(self, which: str, tokens: int, cached: int = 0) -> float:
        if tokens <= 0:
            return 0.0
        if which == "repair":
            return self.repair_factor() * self.predict("target", tokens, cached)
        return self.law(which).seconds(self.shape(which), tokens, cached)

    def repair_factor(self) -> float:
        """How much slower than a causal prefill of the same counts a repaired one ran
        here (the median over the repairs measured; 1 before any, or while the target's
        predictions are in the prior's units)."""
        if not self.repair or not self.measured():
            return 1.0
        return float(np.median([seconds / max(self.predict("target", tokens, cached), 1e-12)
                                for tokens, cached, seconds, _ in self.repair]))

    def load(self) -> None:
        """The saved points, each checked; what cannot be trusted is dropped, said once."""
        try:
            saved = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as error:
            logger.warning("ignoring unreadable prefill costs in %s: %r", self.path, error)
            return
        if not isinstance(saved, dict) or saved.get("version") != VERSION:
            version = saved.get("version") if isinstance(saved, dict) else None
            logger.warning("ignoring prefill costs in %s: version %r, not %d", self.path,
                           version, VERSION)
            return
        shapes = {"target": self.target_shape, "draft": self.draft_shape,
                  "repair": self.target_shape, "followup": self.target_shape,
                  "turns": self.target_shape}
        dropped = 0
        for which, shape in shapes.items():
            entry = saved.get(which)
            if shape is None or not isinstance(entry, dict):
                continue
            if entry.get("shape") != [shape.parameters, shape.attention]:
                logger.warning("ignoring the %s's prefill costs in %s: saved for another "
                               "model shape", which, self.path)
                continue
            points = entry.get("points") if isinstance(entry.get("points"), list) else []
            good = [tuple(p) for p in points if _plausible(p, shape, which != "turns")]
            dropped += len(points) - len(good)
            getattr(self, which).extend(good[-HISTORY:])
        if dropped:
            logger.warning("dropped %d implausible prefill cost points from %s", dropped,
                           self.path)

    def save(self) -> None:
        if self.path is None or not (self.target or self.draft or self.repair):
            return
        saved = {"version": VERSION}
        for which in ("target", "draft", "repair", "followup", "turns"):
            shape = self.shape(which)
            if shape is not None:
                saved[which] = {"shape": [shape.parameters, shape.attention],
                                "points": list(getattr(self, which))}
        save_json(self.path, saved, "prefill costs")


def _record(points: deque, tokens: int, cached: int, seconds: float) -> bool:
    """Append a measured point (tokens, cached, seconds, when) if it can be one."""
    if tokens <= 0 or cached < 0 or not 0 < seconds < _MAX_SECONDS:
        return False
    points.append((int(tokens), int(cached), float(seconds), time.time()))
    return True


def _plausible(point, shape: Shape, prefill: bool = True) -> bool:
    """A saved point this model could have produced on some machine, and recent;
    `prefill`: its seconds are a prefill of its counts (a turn's are not: most of its
    prompt may have been cached)."""
    if not isinstance(point, list) or len(point) != 4:
        return False
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in point):
        return False
    tokens, cached, seconds, at = point
    if tokens < 1 or cached < 0 or not 0 < seconds < _MAX_SECONDS:
        return False
    if not time.time() - MAX_AGE_S < at < time.time() + 86400:
        return False
    rate = seconds / max(sum(shape.flops(int(tokens), int(cached))), 1.0)
    return not prefill or tokens < LONG or _PLAUSIBLE_RATE[0] <= rate <= _PLAUSIBLE_RATE[1]


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
    debt_s: float = 0.0  # what later turns are expected to pay after a SpecPrefill turn

    @property
    def gain(self) -> float:
        return self.dense_s / max(self.specprefill_s, 1e-12)

    def pays(self, margin: float) -> bool:
        """SpecPrefill is worth engaging: the predicted gain beats 1 + margin, and the
        seconds it saves beat the conversation's debt."""
        return self.gain >= 1 + margin and self.dense_s - self.specprefill_s > self.debt_s

    def worth_rechecking(self, shapes: float) -> bool:
        """A decline that the shapes' gain (`shapes_gain`) contradicts is re-checked only
        where that gain would pay too: at least `RECHECK_GAIN`, and saving more of the
        predicted dense seconds than the conversation's debt. The re-check tests the speed
        fit; it never overrides what later turns are measured to pay."""
        return shapes >= RECHECK_GAIN and self.dense_s * (1 - 1 / shapes) > self.debt_s

    def describe(self) -> str:
        debt = f", later turns' debt {self.debt_s:.3f}s" if self.debt_s else ""
        return (f"predicted {self.gain:.2f}x: dense {self.dense_s:.3f}s, "
                f"SpecPrefill {self.specprefill_s:.3f}s{debt}")

    def shortfall(self, margin: float) -> str:
        """Why it does not pay."""
        if self.gain < 1 + margin:
            return f"< {1 + margin:.2f}x"
        return "it saves less than later turns' debt"


def predict(costs: CostModel, prompt_tokens: int, dense_cached: int, draft_cached: int,
            kept_tokens: int) -> Prediction:
    """Dense: the target on what its prefix cache lacks. SpecPrefill: the draft on
    what its prefix cache lacks, then the target on the kept tokens; and what it is
    expected to cost the conversation's later turns, at most the dense prefill that
    would end their chain."""
    dense = costs.predict("target", prompt_tokens - dense_cached, dense_cached)
    sparse = costs.predict("draft", prompt_tokens - draft_cached, draft_cached) + \
        costs.predict("target", kept_tokens)
    return Prediction(dense, sparse, min(costs.debt(prompt_tokens), dense))


def shapes_gain(costs: CostModel, prompt_tokens: int, dense_cached: int, draft_cached: int,
                kept_tokens: int) -> float:
    """The gain the FLOPs alone predict (one rate for both models, no fixed costs)."""
    target, draft = costs.target_shape, costs.draft_shape
    dense = sum(target.flops(prompt_tokens - dense_cached, dense_cached))
    sparse = sum(draft.flops(prompt_tokens - draft_cached, draft_cached)) + \
        sum(target.flops(kept_tokens, 0))
    return dense / max(sparse, 1.0)


def expected_kept(prompt_tokens: int, keep: float, protected: Optional[np.ndarray],
                  chunk_size: int, tail_tokens: int) -> int:
    """About what selection will keep: protected tokens, then keep of the rest."""
    forced = int(protected.sum()) if protected is not None else 0
    rest = prompt_tokens - forced
    return min(prompt_tokens, forced + max(int(np.ceil(keep * rest)), chunk_size + tail_tokens))
