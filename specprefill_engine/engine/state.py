"""One request's state, from submission to its Result, owned by the scheduler.

The caller's thread builds it (prompt tokens, validated options) and from then on
only the worker mutates it, except `cancelled`, the one flag a caller sets.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

import numpy as np

from .output import OutputProcessor
from .results import SpecPrefillReport, Timings, Usage
from .sampling import SamplingParams, make_processors, make_sampler


@dataclass(eq=False)  # identity, never field-wise comparison (token arrays)
class RequestState:
    id: str
    tokens: np.ndarray
    params: SamplingParams
    emit: Callable[[object], None]
    specprefill: Optional[bool] = None
    keep: float = 0.3
    threshold: int = 1024
    stream: bool = False
    progress: bool = False
    response_format: Optional[dict] = None
    logits_processors: list = field(default_factory=list)
    cache_prompt: bool = True
    max_tokens: int = 256
    protected: Optional[np.ndarray] = None  # tokens SpecPrefill must keep (chat segments)
    warnings: list = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    # filled in on the worker
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    report: SpecPrefillReport = field(default_factory=SpecPrefillReport)
    output: Optional[OutputProcessor] = None  # made with the state, on the caller's thread
    prefill: Optional[Generator] = None  # the prefill steps while prefilling
    sampler: Optional[Callable] = None
    processors: list = field(default_factory=list)
    generated: list = field(default_factory=list)  # tokens fed back so far (for processors)
    positions: Optional[np.ndarray] = None  # each prompt cache entry's position; None: all
    reserved_bytes: int = 0
    handle: int = 0  # names the request to the other ranks of a distributed engine
    error: Optional[BaseException] = None  # set by a failed logits processor during a step
    started: Optional[float] = None
    finished: bool = False

    def __post_init__(self):
        self.usage.prompt_tokens = int(self.tokens.size)
        self.report.total_tokens = self.report.kept_tokens = int(self.tokens.size)
        self.report.keep = self.keep

    def start(self, tokenizer, make_constraint: Optional[Callable[[Any, dict], Callable]]):
        """On the worker, when prefill begins: the sampler and logits processors."""
        self.started = time.perf_counter()
        self.timings.queue_wait = self.started - self.submitted
        self.sampler = make_sampler(self.params)
        self.processors = make_processors(self.params, self.tokens[-32:].tolist())
        self.processors.extend(self.logits_processors)
        if self.response_format is not None and make_constraint is not None:
            self.processors.append(make_constraint(tokenizer, self.response_format))
