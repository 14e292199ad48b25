"""Sampling parameters (validated where the caller is), per-request samplers and
logits processors, built on mlx-lm's sampling filters."""

import difflib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from .results import TokenLogprob

# processor(generated tokens of this request (1-D int32), logits (1, vocab)) -> logits
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's bound)


def _number(name: str, value, low: float, high: float, *, low_open=False, high_open=False):
    """A finite real number in the range, else a ValueError/TypeError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
        value < high if high_open else value <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")
    return value


def check_keywords(method: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Python's TypeError for an unexpected keyword, naming what the caller called
    (`method`, e.g. "Engine.generate()") and the nearest valid name."""
    allowed = sorted(allowed)
    for name in given:
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(allowed)}"
            raise TypeError(f"{method} got an unexpected keyword argument {name!r}; {hint}")


def _integer(name: str, value, low: int):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)
    logprobs: Optional[int] = None  # k: each token's logprob and the k likeliest (vLLM's)

    def __post_init__(self):
        _integer("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature, 0, math.inf, high_open=True)
        _number("top_p", self.top_p, 0, 1, low_open=True)
        _integer("top_k", self.top_k, 0)
        _number("min_p", self.min_p, 0, 1, high_open=True)
        if self.repetition_penalty is not None:
            _number("repetition_penalty", self.repetition_penalty, 0, math.inf,
                    low_open=True, high_open=True)
        if self.seed is not None and not 0 <= _integer("seed", self.seed, 0) < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        if not all(stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of integers, got {ids!r}")
        object.__setattr__(
            self, "stop_token_ids", tuple(_integer("stop_token_ids", t, 0) for t in ids)
        )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None and _integer("logprobs", self.logprobs, 0) > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """Greedy at temperature 0; else mlx-lm's filters and the request's own PRNG key,
    so a seeded request samples the same tokens alone or in a batch."""
    if params.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    key = [mx.random.key(params.seed)] if params.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < params.top_p < 1:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        step_key = None
        if key is not None:
            key[0], step_key = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=step_key)

    return sample



@dataclass(eq=False)
class RowSampler:
    """How one row is sampled on rank 0: the request's settings, its sampler (with its own
    PRNG key) and its logits processors (each `(generated tokens, logits) -> logits`)."""

    params: SamplingParams
    sampler: Callable[[mx.array], mx.array]
    processors: list


def row_sampler(params: SamplingParams, prompt_tail: Sequence[int],
                processors: Sequence[LogitsProcessor] = ()) -> RowSampler:
    """A request's sampler: the repetition penalty (seeing the prompt's last tokens),
    then the caller's processors in order."""
    return RowSampler(params, make_sampler(params),
                      [*make_processors(params, prompt_tail), *processors])


GREEDY = RowSampler(SamplingParams(), lambda logprobs: mx.argmax(logprobs, axis=-1), [])


def _processed(row: RowSampler, context: mx.array, logits: mx.array) -> mx.array:
    shape = logits.shape
    for processor in row.processors:
        logits = processor(context, logits)
    if logits.shape != shape:
        raise ValueError(f"a logits processor returned shape {logits.shape}, not {shape}")
    return logits


def sample_rows(rows: list, logits: mx.array, contexts: list,
                failed: Optional[dict] = None) -> tuple[mx.array, Optional[tuple]]:
    """(B, vocab) logits -> (B,) tokens: each row's processors (seeing `contexts[i]`, its
    generated tokens so far), then its sampler. A row whose processors raise is sampled
    from its raw logits and recorded in `failed` (index -> error); the others are
    unaffected. Second, when a row asks for logprobs, `token_logprobs` of the raw logits
    (lazy, in the sample's graph; for every row, at the largest k asked), else None."""
    ks = [row.params.logprobs for row in rows if row.params.logprobs is not None]
    raw = logits
    if any(row.processors for row in rows):
        parts = []
        for index, row in enumerate(rows):
            row_logits = logits[index : index + 1]
            if row.processors:
                try:
                    row_logits = _processed(row, contexts[index], row_logits)
                except Exception as error:  # this row fails; the others go on
                    if failed is None:
                        raise
                    failed[index] = error
                    row_logits = logits[index : index + 1]
            parts.append(row_logits)
        logits = mx.concatenate(parts, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(row.params.greedy for row in rows):
        tokens = mx.argmax(logprobs, axis=-1)
    else:
        tokens = mx.concatenate(
            [row.sampler(logprobs[index : index + 1]) for index, row in enumerate(rows)], axis=0)
    return tokens, (token_logprobs(raw, tokens, max(ks)) if ks else None)


def token_logprobs(logits: mx.array, tokens: mx.array, k: int) -> tuple:
    """Lazy log_softmax of the model's raw logits (before processors, penalties and
    temperature, as vLLM reports them): (B,) the chosen tokens', then for k > 0 (B, k)
    the ids and logprobs of the k likeliest, unordered."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    if k == 0:
        return (chosen,)
    top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    return chosen, top, mx.take_along_axis(logprobs, top, axis=-1)


def read_logprobs(arrays: Optional[tuple], tokens: list, ks: list) -> list:
    """`token_logprobs`' arrays read back: per row, a TokenLogprob of its token with its
    k alternatives, or None where k is None (the row did not ask)."""
    if arrays is None:
        return [None] * len(tokens)
    mx.eval(arrays)
    chosen, *top_k = (a.tolist() for a in arrays)
    ids, values = top_k or (None, None)
    read = []
    for index, (token, k) in enumerate(zip(tokens, ks)):
        top = []
        if k:
            top = sorted(zip(ids[index], values[index]), key=lambda pair: -pair[1])[:k]
        read.append(None if k is None else TokenLogprob(token, chosen[index], top))
    return read


def make_processors(params: SamplingParams, prompt_tail: Sequence[int]) -> list:
    """mlx-lm's repetition penalty, seeing the prompt's last tokens too."""
    if params.repetition_penalty is None:
        return []
    tail = mx.array(list(prompt_tail), dtype=mx.int32)
    return [
        lambda generated, logits, p=p: p(mx.concatenate([tail, generated]), logits)
        for p in make_logits_processors(repetition_penalty=params.repetition_penalty)
    ]


class StopMatcher:
    """Finds stop strings across token boundaries; never emits any part of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False
