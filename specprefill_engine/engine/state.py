"""One request's state, from submission to its Result: the worker's metadata about it.

The caller's thread builds it (prompt tokens, validated options, the grammar compiled)
and from then on only the worker mutates it, except `cancelled`, the one flag a caller
sets. Its progress is fields: `status` (one lifecycle, `Status`), the draft's scoring
(`scoring`), what the target computes (`prefill`, a `Feed`) and what it generated.
The tensors it works with are the executor's, named by `handle`. `describe()` prints it.
"""

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .memory import Reservation
from .output import OutputProcessor
from .plan import Feed
from .results import SpecPrefillReport, Timings, Usage
from .sampling import RowSampler, SamplingParams, row_sampler


class Status(enum.Enum):
    WAITING = "waiting"  # submitted, not admitted
    SCORING = "scoring"  # admitted: the draft scores its prompt
    PREFILLING = "prefilling"  # admitted: the target computes its feed
    LAST_CHUNK = "last chunk"  # its last chunk is planned: the first token comes next
    JOINING = "joining"  # its first token is out: it joins the decode in the next plan
    DECODING = "decoding"
    LEAVING = "leaving"  # its result is out: its cache is stored and released next
    ENDED = "ended"  # released: gone from the table


@dataclass(eq=False)
class Scoring:
    """A request's scoring by the draft, as progress: the prompt through the draft
    (`feed`, before the capturing chunk), then the capturing chunk (`capture`, the
    prompt's last tokens), the lookahead steps, the question's echo (`question`: its
    tokens, forwarded after the prompt; empty: none) and the reduction to importance. With
    nothing to capture the draft only computes the prompt's KV (`feed`: all of it), for
    speculative decoding."""

    feed: Feed
    capture: np.ndarray
    lookahead: int  # lookahead steps left
    question: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    captured: bool = False
    asked: bool = False  # the question's echo is planned
    busy: float = 0.0  # seconds in its units (for the cost model)

    def tokens_done(self) -> int:
        """Prompt tokens through the draft so far."""
        return self.feed.cached + self.feed.fed + (self.capture.size if self.captured else 0)


@dataclass(eq=False, repr=False)  # identity, never field-wise comparison (token arrays)
class RequestState:
    id: str
    tokens: np.ndarray
    params: SamplingParams
    emit: Callable[[object], None]
    keep: float
    threshold: int
    max_tokens: int
    output: OutputProcessor  # made with the state, on the caller's thread
    specprefill: Optional[bool] = None
    stream: bool = False
    progress: bool = False
    constraint: Optional[Callable] = None  # the response_format's processor, built by the caller
    logits_processors: list = field(default_factory=list)
    cache_prompt: bool = True
    num_draft_tokens: int = 0  # speculative decoding: tokens the draft proposes a round
    protected: Optional[np.ndarray] = None  # tokens SpecPrefill must keep (chat segments)
    warnings: list = field(default_factory=list)
    boundaries: tuple = ()  # where chat messages (and the generation prompt) start
    question: Optional[np.ndarray] = None  # positions of the question before later messages
    keep_given: bool = False  # the caller set keep (the request or the engine): no draft check
    called: float = field(default_factory=time.perf_counter)  # the caller's call began
    submitted: float = field(default_factory=time.perf_counter)  # ready for the worker
    cancelled: threading.Event = field(default_factory=threading.Event)

    # filled in on the worker
    handle: int = 0  # names the request in the table, in plans and on the other ranks
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None  # why it ended ("error" with an error)
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    report: SpecPrefillReport = field(default_factory=SpecPrefillReport)
    generated: list = field(default_factory=list)  # tokens sampled and read back so far
    reserved: Reservation = field(default_factory=Reservation)  # KV bytes it may come to hold
    started: Optional[float] = None
    scoring: Optional[Scoring] = None  # the draft's scoring (rank 0 only)
    prefill: Optional[Feed] = None  # what the target computes
    prefill_busy: float = 0.0  # seconds in its chunks (for the cost model)
    scoring_busy: float = 0.0  # seconds in the draft's scoring units (for the cost model)
    continues: int = 0  # the length of a stored turn it continues (for the cost model)
    follows: int = 0  # that turn's, if it continues the turn's sparse view (for the cost model)
    densified: bool = False  # dense after a densified prefix: its entries count as densified
    positions: Optional[np.ndarray] = None  # each prompt cache entry's position; None: all
    view: Optional[np.ndarray] = None  # the positions the same request kept before, to keep again
    repaired: int = 0  # tokens of dropped passages its prefill feeds after later entries
    stored_reply: Optional[int] = None  # at its end: reply tokens its kept cache holds
    speculative: bool = False  # its draft keeps the prompt's KV to propose its reply
    batched: bool = False  # it decodes in the shared batch (which feeds every token read back)
    promoted: bool = False  # the disk tier was consulted for it (before admission)

    def __post_init__(self):
        self.timings.prepare = self.submitted - self.called
        self.usage.prompt_tokens = int(self.tokens.size)
        self.report.total_tokens = self.report.kept_tokens = int(self.tokens.size)
        self.report.keep = self.keep

    @property
    def finished(self) -> bool:
        """Its result or error has gone out."""
        return self.status in (Status.LEAVING, Status.ENDED)

    def start(self) -> RowSampler:
        """On the worker, when the request is admitted: how its tokens are sampled."""
        self.started = time.perf_counter()
        self.timings.queue_wait = self.started - self.submitted
        processors = [*self.logits_processors]
        if self.constraint is not None:
            processors.append(self.constraint)
        return row_sampler(self.params, self.tokens[-32:].tolist(), processors)

    def describe(self) -> str:
        text = f"{self.id} (#{self.handle}) {self.status.value}"
        if self.status is Status.SCORING:
            text += f" {self.scoring.tokens_done()}/{self.tokens.size} tokens through the draft"
        elif self.status is Status.PREFILLING and self.prefill is not None:
            feed = self.prefill
            text += (f" {feed.fed}/{feed.tokens.size} target tokens after {feed.cached} cached"
                     f"{' (sparse)' if feed.positions is not None else ''}")
        elif self.status in (Status.DECODING, Status.LEAVING, Status.ENDED):
            text += f" {len(self.generated)}/{self.max_tokens} tokens"
        if self.finish_reason:
            text += f" [{self.finish_reason}]"
        return text

    __repr__ = describe
