"""Decoding requests together: one forward per step over mlx-lm's batch caches.

A row joins with its own prompt cache, turned into a batch of one by the cache
class's `merge` and appended with `extend` (left padding aligns rows of different
lengths); it leaves through `filter`. Positions are data: a batch cache keeps a
per-row `offset`, which only RoPE reads, apart from the shared write index and
each row's left padding, which the mask reads. A SpecPrefill row holds N + t
entries yet must decode at position M + t, so its offset moves by M - N when it
joins; no wrapper is put on the model.

Steps are pipelined as in mlx-lm's `generate_step`: the next forward is queued
before the tokens of the previous one are read back. With a sharded target (`group`)
rank 0's sampled tokens reach the other ranks inside that same graph.
"""

from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, make_prompt_cache

from ..core import positioned_rope
from ..core.adapters import takes_position_ids
from ..core.prefill import logits_of
from .sampling import SamplingParams
from .state import RequestState

POSITIONED_CACHES = (BatchKVCache, BatchRotatingKVCache)


def broadcast_tokens(tokens: mx.array, group) -> mx.array:
    """Rank 0's tokens on every rank, inside the graph: the other ranks pass zeros
    computed from their own logits, so their forward runs with the same collectives."""
    return mx.distributed.all_sum(tokens.astype(mx.int32), group=group).astype(mx.uint32)


def _processed(row: RequestState, logits: mx.array) -> mx.array:
    generated = mx.array(row.generated, dtype=mx.int32)
    for processor in row.processors:
        logits = processor(generated, logits)
    if logits.ndim != 2 or logits.shape[0] != 1:
        raise ValueError(f"a logits processor returned shape {logits.shape}, not (1, vocab)")
    return logits


def sample_rows(rows: list, logits: mx.array) -> mx.array:
    """(B, vocab) logits -> (B,) tokens: each row's processors, then its sampler."""
    if any(row.processors for row in rows):
        parts = []
        for index, row in enumerate(rows):
            row_logits = logits[index : index + 1]
            if row.processors:
                try:
                    row_logits = _processed(row, row_logits)
                except Exception as error:  # this row fails; the others go on
                    row.error = error
                    row_logits = logits[index : index + 1]
            parts.append(row_logits)
        logits = mx.concatenate(parts, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(row.params.greedy for row in rows):
        return mx.argmax(logprobs, axis=-1)
    return mx.concatenate(
        [row.sampler(logprobs[index : index + 1]) for index, row in enumerate(rows)], axis=0
    )


def as_batch_of_one(cache: list, shift: int) -> list:
    """A request's prompt cache as batch caches, its positions moved by `shift`."""
    merged = [type(layer).merge([layer]) for layer in cache]
    if shift:
        for layer in merged:
            if isinstance(layer, POSITIONED_CACHES):
                layer.offset = layer.offset + shift
    return merged


def batching_support(model: nn.Module) -> str:
    """Why this model's requests cannot share a batched decode; "" when they can.

    Decided by trying: two rows, one with moved positions, through one decode step.
    """
    if takes_position_ids(model):
        return "mlx-vlm multi-axis RoPE: decode positions come from the model's rope-delta carrier"
    cache = make_prompt_cache(model)
    lacking = sorted({type(c).__name__ for c in cache if not hasattr(type(c), "merge")})
    if lacking:
        return f"caches that cannot be merged into a batch: {', '.join(lacking)}"
    try:
        rows = []
        for shift in (0, 3):
            row_cache = make_prompt_cache(model)
            model(mx.array([[1, 2]]), cache=row_cache)
            rows.append(as_batch_of_one(row_cache, shift))
        for layer, other in zip(*rows):
            layer.extend(other)
        mx.eval(logits_of(model(mx.array([[1], [2]]), cache=rows[0])))
    except Exception as error:  # a model whose layers cannot take per-row positions
        return f"batched decode failed on this model: {type(error).__name__}: {error}"
    return ""


# stands in for a row that has left but whose cache row is still there
_VACANT = SimpleNamespace(processors=[], params=SamplingParams(), error=None,
                          sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))


class DecodeBatch:
    """The rows decoding together, their batch caches and their next input tokens.

    A leaving row's slot stays (decoding costs no more for one row more) until half
    the slots are vacant or a row joins: compacting copies the whole batch's KV, and
    rows that started at different times leave at different steps.
    """

    def __init__(self, model: nn.Module, group=None, follower: bool = False):
        self.model = model
        self.group = group  # a distributed group: tokens come from rank 0
        self.follower = follower  # a rank > 0: it samples nothing, reads nothing
        self.slots: list = []  # RequestState, or None once its row has left
        self.cache: Optional[list] = None
        self.inputs: Optional[mx.array] = None  # (B,) next tokens to feed, maybe not evaluated
        self._known: list[bool] = []  # whether a slot's input token was already handed out
        self.plain = False  # one row on its own plain cache

    @property
    def rows(self) -> list[RequestState]:
        return [row for row in self.slots if row is not None]

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: RequestState, cache: list, first_token: int, shift: int) -> None:
        """Join a row whose first token was already sampled and handed out.

        A lone row at its cache's own positions decodes on its plain cache, as mlx-lm's
        generate_step does (a batch cache's mask and per-row offsets cost ~20% per
        token there); the batch cache takes over when a second row joins."""
        self._compact()
        token = mx.array([first_token], dtype=mx.uint32)
        if self.cache is None:
            self.plain = shift == 0
            self.cache = cache if self.plain else as_batch_of_one(cache, shift)
            self.inputs = token
        else:
            if self.plain:
                self.cache, self.plain = as_batch_of_one(self.cache, 0), False
            for layer, other in zip(self.cache, as_batch_of_one(cache, shift)):
                layer.extend(other)
            self.inputs = mx.concatenate([self.inputs, token])
        self.slots.append(row)
        self._known.append(True)

    def step(self) -> list[tuple[RequestState, int]]:
        """Queue one forward for every slot; return the tokens sampled by the previous
        step, (row, token) for each row, now that they are needed."""
        inputs = self.inputs
        logits = logits_of(self.model(inputs[:, None], cache=self.cache))[:, -1, :]
        if self.follower:
            self.inputs = broadcast_tokens(mx.argmax(logits, axis=-1) * 0, self.group)
            mx.async_eval(self.inputs)
            return []
        produced = []
        if any(row.processors for row in self.rows):
            produced = self._read(inputs)  # processors see every token fed so far
        self.inputs = sample_rows([row or _VACANT for row in self.slots], logits)
        if self.group is not None:
            self.inputs = broadcast_tokens(self.inputs, self.group)
        mx.async_eval(self.inputs)
        if not produced:
            produced = self._read(inputs)
        self._known = [False] * len(self.slots)
        return produced

    def _read(self, inputs: mx.array) -> list:
        produced = []
        for row, known, token in zip(self.slots, self._known, inputs.tolist()):
            if row is not None and not known:
                row.generated.append(token)
                produced.append((row, token))
        self._known = [True] * len(self.slots)
        return produced

    def extract(self, row: RequestState) -> list:
        """One row's cache as plain per-layer caches (its left padding removed)."""
        if self.plain:
            return self.cache
        index = self.slots.index(row)
        return [layer.extract(index) for layer in self.cache]

    def remove(self, leaving: set) -> None:
        """Rows leave (finished or aborted); their cache rows go at the next compaction."""
        self.slots = [None if row in leaving else row for row in self.slots]
        if not self.rows:
            self.slots, self._known, self.cache, self.inputs = [], [], None, None
        elif 2 * self.slots.count(None) >= len(self.slots):
            self._compact()

    def _compact(self) -> None:
        keep = [i for i, row in enumerate(self.slots) if row is not None]
        if len(keep) == len(self.slots):
            return
        self.slots = [self.slots[i] for i in keep]
        self._known = [self._known[i] for i in keep]
        if not keep:
            self.cache = self.inputs = None
            return
        indices = mx.array(keep, dtype=mx.int32)
        for layer in self.cache:
            layer.filter(indices)
        self.inputs = self.inputs[indices]


class SoloDecode:
    """One row of a model whose caches cannot be batched: a forward per step, its
    positions set for that call (the prefill's per-call handling) and cleared after."""

    def __init__(self, model: nn.Module, row: RequestState, cache: list, first_token: int,
                 shift: int, group=None, follower: bool = False):
        self.model, self.row, self.cache, self.shift = model, row, cache, shift
        self.group, self.follower = group, follower
        self.rows = [row]
        self.token = first_token

    def extract(self, row: RequestState) -> list:
        return self.cache

    def step(self) -> list[tuple[RequestState, int]]:
        with positioned_rope(self.model, shift=self.shift):
            output = self.model(mx.array([[self.token]]), cache=self.cache)
        logits = logits_of(output)[:, -1, :]
        if self.follower:
            token = broadcast_tokens(mx.argmax(logits, axis=-1) * 0, self.group)
            self.token = token.item()
            return []
        token = sample_rows(self.rows, logits)
        if self.group is not None:
            token = broadcast_tokens(token, self.group)
        self.token = token.item()
        self.row.generated.append(self.token)
        return [(self.row, self.token)]
