"""One request's life on the worker: prefix lookup, prefill, decode, finish.

`run_request` is a generator that yields between units of work (a draft chunk, a
lookahead step, a prefill chunk, a decoded token). The worker round-robins over
the generators of all active requests, so one long prefill does not stall the
others' decoding, and it throws `Cancelled` into a generator to abort it. Every
model call sets its own RoPE state and clears it after, so requests never see each
other's positions.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from ..core import positioned_rope, select_chunks, sparse_prefill_steps
from ..core.adapters import check_sparse_prefill_supported
from ..core.sparse_prefill import cover_sliding_window
from .prefix_cache import PrefixCache
from .results import Chunk, Progress, Result, SpecPrefillReport, Timings, Usage
from .runtime import Runtime
from .sampling import SamplingParams, StopMatcher, make_processors, make_sampler


class Cancelled(Exception):
    """Thrown into a request's generator when its caller aborts it."""


@dataclass
class Request:
    id: str
    tokens: np.ndarray
    params: SamplingParams
    emit: Callable[[object], None]
    specprefill: Optional[bool] = None
    keep: Optional[float] = None
    stream: bool = False
    progress: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


def dense_prefill_steps(model, tokens: mx.array, cache, step_size: int) -> Generator:
    """Prefill in chunks, yielding (tokens done, tokens); returns the last token's logits.

    Each call sets its own (zero) position state: another request's may have run in
    between (for mlx-vlm models, the rope-delta carrier)."""
    for start in range(0, tokens.size - 1, step_size):
        end = min(start + step_size, tokens.size - 1)
        with positioned_rope(model):
            model(tokens[start:end][None], cache=cache)
        mx.eval([c.state for c in cache])
        yield end, tokens.size
    with positioned_rope(model):
        logits = model(tokens[-1:][None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def _reporting(steps: Generator, request: Request, phase: str) -> Generator:
    """Pass a step generator through, emitting Progress when the caller asked for it."""
    while True:
        try:
            done, total = next(steps)
        except StopIteration as finished:
            return finished.value
        if request.progress:
            request.emit(Progress(phase, done, total))
        yield


def _decision(request: Request, runtime: Runtime, suffix_length: int) -> tuple[bool, str]:
    if request.specprefill is False:
        return False, "disabled for this request"
    if runtime.scorer is None:
        return False, "no draft model configured"
    if request.specprefill is None and suffix_length < runtime.config.threshold:
        return False, f"prompt below threshold ({suffix_length} < {runtime.config.threshold} tokens)"
    return True, "engaged"


def _specprefill(request, runtime, cache, cached, report, timings) -> Generator:
    """Score the whole prompt, select in the uncached suffix, sparse-prefill it."""
    config = runtime.config
    check_sparse_prefill_supported(runtime.model)  # before spending the draft's time
    tokens = mx.array(request.tokens)
    scoring_started = time.perf_counter()
    importance = yield from _reporting(runtime.scorer.score_steps(tokens), request, "scoring")
    timings.scoring = time.perf_counter() - scoring_started
    selected = select_chunks(
        importance[cached:], report.keep, config.chunk_size, config.backbone_pct,
        config.tail_tokens,
    )
    selected = cover_sliding_window(selected, cache, tokens.size - cached, cached)
    report.kept_tokens = int(selected.size)
    return (
        yield from _reporting(
            sparse_prefill_steps(
                runtime.model, tokens[cached:], selected, cache, config.step_size, cached
            ),
            request,
            "prefill",
        )
    )


def _fresh_cache(model, tokens: np.ndarray, prefix_cache: Optional[PrefixCache]):
    if prefix_cache is None:
        return make_prompt_cache(model), 0
    return prefix_cache.lookup(model, tokens)


class _Output:
    """Detokenizes, applies stop rules, and emits chunks for one request."""

    def __init__(self, request: Request, runtime: Runtime):
        self.request = request
        self.stop_ids = set(runtime.tokenizer.eos_token_ids) | set(request.params.stop_token_ids)
        self.detokenizer = runtime.tokenizer.detokenizer
        self.stopper = StopMatcher(request.params.stop)
        self.tokens, self.parts = [], []
        self.first_token_at = None

    def accept(self, token: int) -> Optional[str]:
        """Take one token; return a finish reason when the request is done."""
        if token in self.stop_ids:
            return "stop"
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        self.detokenizer.add_token(token)
        text, hit = self.stopper.feed(self.detokenizer.last_segment)
        self.parts.append(text)
        if self.request.stream and (text or not hit):
            self.request.emit(Chunk(text, [token], request_id=self.request.id))
        return "stop" if hit else None

    def finish_text(self, reason: str) -> str:
        """Text held back for stop matching, released unless a stop string hit."""
        if reason == "stop":
            return ""
        self.detokenizer.finalize()
        tail, _ = self.stopper.feed(self.detokenizer.last_segment)
        tail += self.stopper.flush()
        self.parts.append(tail)
        return tail


def _prefill(request, runtime, cache, cached, prefix_cache, report, timings) -> Generator:
    """SpecPrefill when the policy says so (dense on any failure); returns (logits, shift)."""
    model = runtime.model
    report.engaged, report.reason = _decision(request, runtime, request.tokens.size - cached)
    if report.engaged:
        report.total_tokens = int(request.tokens.size) - cached
        try:
            return (yield from _specprefill(request, runtime, cache, cached, report, timings))
        except Cancelled:
            raise
        except Exception as error:
            report.engaged = False
            report.reason = f"fell back to dense prefill: {type(error).__name__}: {error}"
            report.kept_tokens = report.total_tokens
            cache[:], cached = _fresh_cache(model, request.tokens, prefix_cache)
    suffix = mx.array(request.tokens[cached:])
    logits = yield from _reporting(
        dense_prefill_steps(model, suffix, cache, runtime.config.step_size), request, "prefill"
    )
    if prefix_cache is not None:
        prefix_cache.store(request.tokens, cache)
    return logits, 0


def _decode(request, runtime, cache, logits, shift, output: _Output) -> Generator:
    """Sample the first token from the prefill logits, then mlx-lm's pipelined steps."""
    params = request.params
    model = runtime.model
    sampler = make_sampler(params)
    processors = make_processors(params, request.tokens[-32:].tolist())
    for processor in processors or ():
        logits = processor(mx.array([], dtype=mx.int32), logits)
    first = sampler(logits - mx.logsumexp(logits, keepdims=True)).item()
    reason = output.accept(first)
    if reason is not None or params.max_tokens == 1:
        return reason or "length"
    steps = generate_step(
        mx.array([first]), model, max_tokens=params.max_tokens - 1, sampler=sampler,
        logits_processors=processors, prompt_cache=cache,
    )
    try:
        while reason is None:
            yield
            with positioned_rope(model, shift=shift):
                token, _ = next(steps, (None, None))
            if token is None:
                return "length"
            reason = output.accept(int(token))
    finally:
        steps.close()
    return reason


def run_request(
    request: Request, runtime: Runtime, prefix_cache: Optional[PrefixCache]
) -> Generator[None, None, None]:
    """The whole request; emits chunks (when streaming), then a Result or an error."""
    started = time.perf_counter()
    timings = Timings(queue_wait=started - request.submitted)
    prompt_length = int(request.tokens.size)
    keep = runtime.config.keep if request.keep is None else request.keep
    report = SpecPrefillReport(total_tokens=prompt_length, kept_tokens=prompt_length, keep=keep)
    usage = Usage(prompt_tokens=prompt_length)
    output = _Output(request, runtime)
    try:
        yield
        cache, usage.cached_tokens = _fresh_cache(runtime.model, request.tokens, prefix_cache)
        logits, shift = yield from _prefill(
            request, runtime, cache, usage.cached_tokens, prefix_cache, report, timings
        )
        timings.prefill = time.perf_counter() - started - timings.scoring
        reason = yield from _decode(request, runtime, cache, logits, shift, output)
    except Cancelled:
        reason = "abort"
    except Exception as error:
        request.emit(error)
        return
    if output.first_token_at is not None:
        timings.time_to_first_token = output.first_token_at - request.submitted
    if len(output.tokens) > 1:
        elapsed = time.perf_counter() - output.first_token_at
        timings.decode_tokens_per_s = (len(output.tokens) - 1) / max(elapsed, 1e-9)
    tail = output.finish_text(reason)
    usage.completion_tokens = len(output.tokens)
    if request.stream:
        request.emit(Chunk(tail, [], reason, usage, timings, report, request.id))
    request.emit(
        Result("".join(output.parts), output.tokens, reason, usage, timings, report, request.id)
    )
