"""One request's state, from submission to its Result, owned by the scheduler.

The caller's thread builds it (prompt tokens, validated options, the grammar compiled)
and from then on only the worker mutates it, except `cancelled`, the one flag a caller
sets. Its progress is fields, not a generator's frame: `status`, and while prefilling
what the target computes (`feed`, at `feed_positions`, after `cached` restored entries)
and how far it got (`fed` of them, in `chunk_ends`). `describe()` prints it.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Optional

import numpy as np

from .output import OutputProcessor
from .plan import Restore
from .results import SpecPrefillReport, Timings, Usage
from .sampling import SamplingParams, make_processors, make_sampler

WAITING, SCORING, PREFILLING, DECODING, ENDED = "waiting", "scoring", "prefilling", "decoding", "ended"


@dataclass(eq=False, repr=False)  # identity, never field-wise comparison (token arrays)
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
    constraint: Optional[Callable] = None  # the response_format's processor, built by the caller
    logits_processors: list = field(default_factory=list)
    cache_prompt: bool = True
    max_tokens: int = 256
    protected: Optional[np.ndarray] = None  # tokens SpecPrefill must keep (chat segments)
    warnings: list = field(default_factory=list)
    boundaries: tuple = ()  # where chat messages (and the generation prompt) start
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    # filled in on the worker
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    report: SpecPrefillReport = field(default_factory=SpecPrefillReport)
    output: Optional[OutputProcessor] = None  # made with the state, on the caller's thread
    sampler: Optional[Callable] = None
    processors: list = field(default_factory=list)
    generated: list = field(default_factory=list)  # tokens sampled and read back so far
    status: str = WAITING
    handle: int = 0  # names the request in turn plans (and to the other ranks)
    reserved_bytes: int = 0
    started: Optional[float] = None
    # scoring (the draft, rank 0 only): its unit generator and progress
    scoring: Optional[Generator] = None
    scoring_cache: Optional[list] = None  # the draft's cache while scoring
    scored: tuple = (0, 0)  # (prompt tokens through the draft, all)
    scoring_busy: float = 0.0  # seconds spent in its units (for the cost model)
    # the target prefill: what to restore, what to feed and where each token sits
    restore: Optional[Restore] = None
    feed: Optional[np.ndarray] = None
    feed_positions: Optional[np.ndarray] = None  # None: consecutive after the cached entries
    cached: int = 0  # entries restored from the prefix cache
    densified: bool = False  # dense after a densified prefix: its entries count as densified
    fed: int = 0  # feed tokens computed (planned: a failure ends the request)
    prefill_busy: float = 0.0  # seconds spent in its chunks (for the cost model)
    chunk_ends: list = field(default_factory=list)  # (end, pause) of the planned chunks
    checkpoints: dict = field(default_factory=dict)  # chunk end -> the prompt length it is
    positions: Optional[np.ndarray] = None  # each prompt cache entry's position; None: all
    shift: int = 0  # decode position minus cache entries (SpecPrefill rows)
    first_token: Optional[int] = None  # sampled, not yet joined to a decode
    finish_reason: Optional[str] = None
    finished: bool = False  # its Result or error has gone out

    def __post_init__(self):
        self.usage.prompt_tokens = int(self.tokens.size)
        self.report.total_tokens = self.report.kept_tokens = int(self.tokens.size)
        self.report.keep = self.keep

    def start(self) -> None:
        """On the worker, when the request is admitted: its sampler and processors."""
        self.started = time.perf_counter()
        self.timings.queue_wait = self.started - self.submitted
        self.sampler = make_sampler(self.params)
        self.processors = make_processors(self.params, self.tokens[-32:].tolist())
        self.processors.extend(self.logits_processors)
        if self.constraint is not None:
            self.processors.append(self.constraint)

    def describe(self) -> str:
        text = f"{self.id} (#{self.handle}) {self.status}"
        if self.status == SCORING:
            text += f" {self.scored[0]}/{self.scored[1]} tokens through the draft"
        elif self.status == PREFILLING and self.feed is not None:
            text += (f" {self.fed}/{self.feed.size} target tokens after {self.cached} cached"
                     f"{' (sparse)' if self.feed_positions is not None else ''}")
        elif self.status in (DECODING, ENDED):
            text += f" {len(self.generated)}/{self.max_tokens} tokens"
        if self.finish_reason:
            text += f" [{self.finish_reason}]"
        return text

    __repr__ = describe
