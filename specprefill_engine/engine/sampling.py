"""Sampling parameters, the sampler they make, and stop-string matching."""


from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors


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

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0 or not 0 <= self.min_p < 1:
            raise ValueError("top_k must be >= 0 and min_p in [0, 1)")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def make_sampler(params: SamplingParams):
    """Greedy at temperature 0; else mlx-lm's filters and a per-request PRNG key."""
    if params.temperature == 0:
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


def make_processors(params: SamplingParams, prompt_tail: Sequence[int]):
    """mlx-lm logits processors that also see the prompt's last tokens."""
    if params.repetition_penalty is None:
        return None
    processors = make_logits_processors(repetition_penalty=params.repetition_penalty)
    tail = mx.array(list(prompt_tail), dtype=mx.int32)
    return [lambda tokens, logits, p=p: p(mx.concatenate([tail, tokens]), logits) for p in processors]


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

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


