"""Densify while idle: after a SpecPrefill turn, compute that turn's dense KV.

Between two turns of an agent the model is idle while the agent runs its tools and a
person reads. A SpecPrefill turn's stored cache holds only the kept entries, so the next
turn either reuses that sparse view (behind the coverage gate) or selects anew. With
`densify="idle"`, the engine computes the turn's dense KV (prompt and reply) in ordinary
prefill units while nothing else runs, and keeps it as a dense prefix-cache entry; the
next turn continues from a dense prefix and answers as dense would.

A job takes one unit per scheduler turn, only in turns with no request waiting,
prefilling, joining or decoding, so an arriving request waits at most one unit; what a
job has computed is stored after each unit (each store absorbs the one before), so a
paused job is usable as it stands. A finished job drops the sparse entry it replaces.
A job continues from the longest dense prefix already cached (an earlier turn's
densified KV), so an agent's loop densifies only what each turn adds.
"""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..core.prefill import chunk_plan, prefill_weight
from .plan import Restore, Store, TurnPlan
from .prefill import unit_chunks
from .prefix_cache import PrefixCache



@dataclass
class DensifyStats:
    """What densification has done so far (`Engine.stats()`)."""

    entries: int = 0  # turns densified to the end
    tokens: int = 0  # tokens computed
    seconds: float = 0.0  # time in its prefill units
    pending: int = 0  # turns waiting to be densified


@dataclass(eq=False)
class Job:
    """A turn to densify: `tokens` (its prompt and the reply fed), and its progress."""

    handle: int
    tokens: np.ndarray
    replaces: Optional[int] = None  # the sparse entry's key, once stored
    restore: Optional[Restore] = None
    cached: int = 0  # tokens of a dense prefix restored
    feed: Optional[np.ndarray] = None
    fed: int = 0
    chunk_ends: list = field(default_factory=list)
    stored: int = 0  # tokens kept as a dense entry so far
    failed: bool = False

    @property
    def done(self) -> int:
        return self.cached + self.fed


def start(job: Job, model, target: PrefixCache, step_size: int) -> bool:
    """Decide where the job continues from; False when nothing is left to compute."""
    hit = target.find(job.tokens, dense_only=True)
    cut = hit.cut if hit is not None else 0
    if cut >= job.tokens.size - 1:
        return False
    job.restore = Restore(job.handle, hit.entry.key if cut else -1, cut)
    job.cached, job.feed, job.fed = cut, job.tokens[cut:], 0
    job.chunk_ends = chunk_plan(int(job.feed.size), cut, step_size, prefill_weight(model))
    return True


def plan_unit(plan: TurnPlan, job: Job) -> None:
    """The job's next unit of prefill work (no logits: nothing is sampled)."""
    if job.fed == 0:
        plan.restores.append(job.restore)
    chunks, job.fed = unit_chunks(job.handle, job.feed, None, job.fed, job.chunk_ends)
    for chunk in chunks:
        chunk.last = False
    plan.chunks += chunks


def plan_store(plan: TurnPlan, job: Job) -> None:
    """Keep what the job has computed (a view of its cache, no copy)."""
    if job.done > job.stored:
        plan.stores.append(Store(job.handle, job.tokens[: job.done], densified=True))
        job.stored = job.done
