"""Densify while idle: after a SpecPrefill turn, compute that turn's dense KV.

Between two turns of an agent the model is idle while the agent runs its tools and a
person reads. A SpecPrefill turn's stored cache holds only the kept entries, so the next
turn either reuses that sparse view (behind the coverage gate) or selects anew. With
`densify="idle"`, the engine computes the turn's dense KV (prompt and reply) in ordinary
prefill units while nothing else runs, and keeps it as a dense prefix-cache entry; the
next turn continues from a dense prefix and answers as dense would.

A job takes one unit per turn, only in turns with no request waiting,
prefilling, joining or decoding, so an arriving request waits at most one unit; what a
job has computed is stored after each unit (each store absorbs the one before), so a
paused job is usable as it stands. A finished job drops the sparse entry it replaces.
With `densify="decode"` a job also takes one unit in a turn whose requests only decode:
each of their tokens then waits for at most one unit, as for another request's prefill
(`DensifyStats.decode_units` counts them). That pays only where prefill is cheap against
the reply's decode and the next turn comes before any idle time (a large GPU, tools that
return at once); where prefill is slow against decode (a Mac) it slows a long run of
reply tokens.
A job continues from the longest dense prefix already cached (an earlier turn's
densified KV), so an agent's loop densifies only what each turn adds.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..core.prefill import chunk_plan, prefill_weight
from .plan import Feed, Store
from .prefix_cache import PrefixIndex, restore_of


@dataclass
class DensifyStats:
    """What densification has done so far (`Engine.stats()`)."""

    entries: int = 0  # turns densified to the end
    tokens: int = 0  # tokens computed
    seconds: float = 0.0  # time in its prefill units
    pending: int = 0  # turns waiting to be densified
    decode_units: int = 0  # units run in a turn with a decode step (densify="decode")


@dataclass(eq=False)
class Job:
    """A turn to densify: `tokens` (its prompt and the reply fed), and its progress."""

    handle: int
    tokens: np.ndarray
    replaces: Optional[int] = None  # the sparse entry's key
    prompt: int = 0  # the turn's prompt length, its reply after it
    feed: Optional[Feed] = None  # once started: after a dense prefix, the rest
    stored: int = 0  # tokens kept as a dense entry so far
    failed: bool = False

    @property
    def done(self) -> int:
        return 0 if self.feed is None else self.feed.cached + self.feed.fed


def start(job: Job, model, target: PrefixIndex, step_size: int) -> bool:
    """Decide where the job continues from; False when nothing is left to compute."""
    hit = target.find(job.tokens, dense_only=True)
    cut = hit.cut if hit is not None else 0
    if cut >= job.tokens.size - 1:
        return False
    job.feed = Feed(restore_of(job.handle, hit, cut), job.tokens[cut:], cached=cut,
                    chunk_ends=chunk_plan(int(job.tokens.size - cut), cut, step_size,
                                          prefill_weight(model)))
    return True


def store(job: Job) -> Optional[Store]:
    """Keep what the job has computed (a view of its cache, no copy), if anything new."""
    if job.done <= job.stored:
        return None
    job.stored = job.done
    return Store(job.handle, job.tokens[: job.done], densified=True, prompt=job.prompt)
